"""The compiled binding (colibri._colibri_cffi), the status codes and ColibriError."""
from colibri.dtypes import DTYPES

try:
    from colibri._colibri_cffi import ffi, lib
except ImportError as exc:  # the extension is built by `make python`, not by pip
    raise ImportError(
        f"colibri: the native extension is missing or cannot load ({exc}); build it with `make` "
        "(or `python backend_src/colibri/_ffi_build.py --lib build/libcolibri.so`)") from exc

STATUS_OK = lib.COLIBRI_OK
STATUS_INVALID_ARGUMENT = lib.COLIBRI_ERR_INVALID_ARGUMENT
STATUS_OUT_OF_MEMORY = lib.COLIBRI_ERR_OUT_OF_MEMORY
STATUS_UNSUPPORTED = lib.COLIBRI_ERR_UNSUPPORTED
STATUS_CUDA = lib.COLIBRI_ERR_CUDA
STATUS_ROUTING = lib.COLIBRI_ERR_ROUTING
STATUS_INTERNAL = lib.COLIBRI_ERR_INTERNAL

DTYPE_CODES = {name: getattr(lib, d.c_enum) for name, d in DTYPES.items()}
EXPERT_KIND_CODES = {"swiglu": lib.COLIBRI_EXPERT_SWIGLU, "linear": lib.COLIBRI_EXPERT_LINEAR}
# colibri.h's COLIBRI_ROUTING_* by their lowercase names ("softmax_topk", ...), in enum order: a routing
# added to the header needs no entry here
ROUTING_CODES = dict(sorted(((n[len("COLIBRI_ROUTING_"):].lower(), getattr(lib, n)) for n in dir(lib)
                            if n.startswith("COLIBRI_ROUTING_")), key=lambda item: item[1]))
DEVICE_CODES = {"cpu": lib.COLIBRI_DEVICE_CPU, "cuda": lib.COLIBRI_DEVICE_CUDA}
ACTIVATION_CODES = {"silu": lib.COLIBRI_ACTIVATION_SILU, "swiglu_oai": lib.COLIBRI_ACTIVATION_SWIGLU_OAI}
GROUP_SCORE_CODES = {"max": lib.COLIBRI_GROUP_SCORE_MAX, "top2_sum": lib.COLIBRI_GROUP_SCORE_TOP2_SUM}


def status_name(status: int) -> str:
    return ffi.string(lib.colibri_status_string(status)).decode()


class ColibriError(Exception):
    """A failure of the library (status and message from colibri_status_string / colibri_last_error)
    or bad input found in Python before the call (status STATUS_INVALID_ARGUMENT)."""

    def __init__(self, message: str, status: int = STATUS_INVALID_ARGUMENT):
        super().__init__(message)
        self.status = int(status)
        self.status_name = status_name(self.status)

    def __str__(self) -> str:
        return f"{self.status_name}: {self.args[0]}"


def check(status: int, what: str) -> None:
    """Raises ColibriError for a non-OK status, with the library's message for this thread."""
    if status != STATUS_OK:
        detail = ffi.string(lib.colibri_last_error()).decode(errors="replace")
        raise ColibriError(f"{what}: {detail}" if detail else what, status)


def invalid(message: str) -> ColibriError:
    return ColibriError(message, STATUS_INVALID_ARGUMENT)
