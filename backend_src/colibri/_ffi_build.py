"""Builds colibri._colibri_cffi, the cffi (API mode) extension that binds libcolibri.

    python backend_src/colibri/_ffi_build.py --lib build/libcolibri.so [--out DIR]

The cdef is the block of csrc/include/colibri.h between COLIBRI_CDEF_BEGIN and COLIBRI_CDEF_END, so
the header stays the one source of truth. The extension and a copy of libcolibri.so land side by side
in backend_src/colibri/ (`make python`) or in --out (backend_src/setup.py, building a wheel), linked
with rpath $ORIGIN: the package folder is self-contained and keeps
working when copied elsewhere (a Docker image, Triton's model folder). Both are replaced by rename,
and only when their bytes change, so rebuilding never disturbs a server that has them loaded.
"""
import argparse
import filecmp
import os
import pathlib
import shutil
import sys
import tempfile

import cffi

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
BEGIN_MARKER = "/* COLIBRI_CDEF_BEGIN */"
END_MARKER = "/* COLIBRI_CDEF_END */"

# DLPack's ABI (dlpack.h v1.0, written out here since the header is not shipped with the library):
# both the legacy DLManagedTensor (capsule "dltensor") and DLManagedTensorVersioned
# (capsule "dltensor_versioned"). Used by colibri/dlpack.py to read and export tensors zero-copy.
DLPACK_DECLS = """
typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;
"""

# Python-side callbacks (cffi takes the GIL in them, so a consumer may call the deleter from any
# thread) and the PyCapsule destructor of exported tensors, which must run in C: it is called while
# the capsule is being freed, when touching it from Python is no longer safe.
CALLBACK_CDEF = """
extern "Python" void colibri_py_dlpack_deleter(DLManagedTensor *self);
extern "Python" colibri_status_t colibri_py_routing_fn(
    void *user_data, int64_t num_tokens, int32_t num_experts, int32_t top_k, colibri_dtype_t act_dtype,
    const void *hidden_states, const float *router_logits, int32_t *topk_ids, float *topk_weights,
    void *stream);
void colibri_py_capsule_destructor(void *capsule);
"""

CAPSULE_DESTRUCTOR_SOURCE = """
static void colibri_py_capsule_destructor(void *object) {
    PyObject *capsule = (PyObject *)object;
    PyObject *type, *value, *traceback;
    /* A consumer renames the capsule to "used_dltensor" and then owns the tensor; only an unconsumed
     * capsule still holds it. The destructor may run while an exception is set: keep it. */
    PyErr_Fetch(&type, &value, &traceback);
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *managed = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        if (managed && managed->deleter) managed->deleter(managed);
    }
    PyErr_Restore(type, value, traceback);
}
"""


def read_cdef(header: pathlib.Path) -> str:
    text = header.read_text()
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin < 0 or end < begin:
        sys.exit(f"_ffi_build: {header} has no {BEGIN_MARKER} ... {END_MARKER} block")
    return text[begin + len(BEGIN_MARKER):end]


def make_ffi(header: pathlib.Path, build_dir: str = "", lib_dir: pathlib.Path = PACKAGE_DIR) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(read_cdef(header) + DLPACK_DECLS + CALLBACK_CDEF)
    ffi.set_source(
        "colibri._colibri_cffi",
        '#include "colibri.h"\n' + DLPACK_DECLS + CAPSULE_DESTRUCTOR_SOURCE,
        include_dirs=[str(header.parent)],
        library_dirs=[str(lib_dir)],
        libraries=["colibri"],
        extra_link_args=["-Wl,-rpath,$ORIGIN"],
        # The build folder's name kept out of the binary: the same sources give the same bytes, so an
        # unchanged rebuild leaves the installed extension alone.
        extra_compile_args=["-O2"] + ([f"-ffile-prefix-map={build_dir}=."] if build_dir else []),
    )
    return ffi


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, type=pathlib.Path, help="the built libcolibri.so")
    parser.add_argument("--header", type=pathlib.Path, default=REPO_ROOT / "csrc/include/colibri.h")
    parser.add_argument("--out", type=pathlib.Path, default=PACKAGE_DIR,
                        help="folder for the extension and the library's copy (default: the package's own)")
    args = parser.parse_args(argv)
    if not args.lib.is_file():
        sys.exit(f"_ffi_build: {args.lib} not found (run make lib first)")
    changed = build(args.lib, args.header, args.out)
    shown = args.out.resolve()
    shown = shown.relative_to(REPO_ROOT) if REPO_ROOT in shown.parents else shown
    print(f"colibri: python extension in {shown}: "
          + (f"replaced {', '.join(changed)}" if changed else "up to date"))


def build(lib: pathlib.Path, header: pathlib.Path, out: pathlib.Path) -> list:
    """Puts a copy of lib and the extension linked to it into out; returns the names it replaced."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Copy first and link against the copy, so the extension records the library it will load.
    changed = [name for name in (install(lib, out / "libcolibri.so"),) if name]
    with tempfile.TemporaryDirectory(prefix="colibri-cffi-") as tmp:
        ffi = make_ffi(header.resolve(), tmp, out)
        built = pathlib.Path(ffi.compile(tmpdir=tmp, verbose=False))
        changed += [name for name in (install(built, out / built.name),) if name]
    return changed


def install(source: pathlib.Path, target: pathlib.Path):
    """Puts source at target by writing beside it and renaming, so a process that has the old file
    loaded (a serving Triton stub) keeps its mapping intact; rewriting a loaded .so in place crashes
    it. An identical target is left alone. Returns the target's name if it was replaced."""
    if target.is_file() and filecmp.cmp(source, target, shallow=False):
        return None
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        shutil.copy2(source, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target.name


if __name__ == "__main__":
    main()
