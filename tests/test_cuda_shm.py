"""CUDA shared memory with cupy alone (colibri.serving.cuda_shm, client/cuda_shm_client.py, loadtest's
CudaShmUser): what a host without a GPU or without cupy is told, the IPC handle as Triton receives it
over gRPC and HTTP, and on a GPU a region's bytes seen through its handle from another process."""
import base64
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import types
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from colibri.serving import cuda_shm
from colibri.testing.server import REPO_ROOT


@pytest.mark.parametrize("text, major", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n", 535),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n", 580),
    ("NVRM version: something else\n", 0),
])
def test_driver_version_from_the_kernel_modules_file(tmp_path, text, major):
    (tmp_path / "version").write_text(text)
    assert cuda_shm.nvidia_driver(tmp_path / "version") == major


def test_driver_version_from_nvidia_smi_without_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cuda_shm.nvidia_driver(tmp_path / "absent") is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 550.54.15\n")
    smi.chmod(0o755)
    assert cuda_shm.nvidia_driver(tmp_path / "absent") == 550


@pytest.mark.parametrize("driver, words, absent", [
    (580, ["cupy-cuda12x", "R580"], "cupy-cuda11x"), (525, ["cupy-cuda12x"], "cupy-cuda11x"),
    (470, ["cupy-cuda11x", "R470"], "cupy-cuda12x"), (418, ["R418", "update the driver"], "pip install"),
    (0, ["cupy-cuda12x", "R525+", "cupy-cuda11x", "R450+"], "update")])
def test_cupy_advice_follows_the_driver(driver, words, absent):
    advice = cuda_shm.cupy_advice(driver)
    assert all(word in advice for word in words) and absent not in advice, advice


# --- the handle as Triton receives it ---------------------------------------------------------------

HANDLE = bytes(range(64))  # a cudaIpcMemHandle_t's 64 bytes, zeros included


def fake_cupy(allocations):
    """Enough of cupy for CudaShmRegion's constructor: Memory records its size and the device current
    when it was made; ipcGetMemHandle answers HANDLE for it."""
    current = {"device": 0}

    class Device:
        def __init__(self, device_id):
            self.device_id = device_id

        def __enter__(self):
            self.previous, current["device"] = current["device"], self.device_id

        def __exit__(self, *exc):
            current["device"] = self.previous

    class Memory:
        def __init__(self, nbytes):
            self.ptr, self.nbytes, self.device = 0x7f0000000000 + len(allocations), nbytes, current["device"]
            allocations.append(self)

    def ipc_get_mem_handle(ptr):
        assert ptr in [m.ptr for m in allocations], ptr
        return HANDLE

    runtime = types.SimpleNamespace(ipcGetMemHandle=ipc_get_mem_handle)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device, Memory=Memory, runtime=runtime))


def grpc_server(received):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def CudaSharedMemoryRegister(self, request, context):
            received.append((request.name, request.raw_handle, request.device_id, request.byte_size))
            return service_pb2.CudaSharedMemoryRegisterResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def http_server(received):
    import json

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            name = self.path.split("/")[-2]
            received.append((name, base64.b64decode(body["raw_handle"]["b64"]), body["device_id"], body["byte_size"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def test_handle_reaches_triton_as_its_64_bytes_over_grpc_and_http(monkeypatch):
    """register() gives both tritonclient clients what they encode for Triton: the server receives the
    handle's 64 bytes exactly, with the region's name, device and size; the region is a cudaMalloc of
    its own on that device (cupy.cuda.Memory), not a pool chunk."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    httpclient = pytest.importorskip("tritonclient.http")
    allocations = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(allocations))
    region = cuda_shm.CudaShmRegion("colibri_test_in", 4096, device_id=1)
    assert [(m.nbytes, m.device) for m in allocations] == [(4096, 1)]

    received = []
    server, url = grpc_server(received)
    client = grpcclient.InferenceServerClient(url)
    try:
        region.register(client)
    finally:
        client.close()
        server.stop(None)
    web, address = http_server(received)
    client = httpclient.InferenceServerClient(address)
    try:
        region.register(client)
    finally:
        client.close()
        web.shutdown()
    assert received == [("colibri_test_in", HANDLE, 1, 4096)] * 2


# --- on a GPU ---------------------------------------------------------------------------------------

OPEN_IN_ANOTHER_PROCESS = """
import base64, sys
import cupy, numpy as np
raw_handle, nbytes = sys.argv[1], int(sys.argv[2])
with cupy.cuda.Device(0):
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(base64.b64decode(raw_handle))
    host = np.empty(nbytes, np.uint8)
    cupy.cuda.runtime.memcpy(host.ctypes.data, ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
sys.stdout.write(host.tobytes().hex())
"""


@pytest.mark.skipif("cuda_shm.host_problem(0) is not None", reason="needs a CUDA GPU and cupy")
def test_region_bytes_are_what_another_process_opens():
    """What write() put in a region is what a process opening its handle reads (Triton's side), and
    read() copies it back; bf16 travels as its uint16 bits. Made after a pool allocation, so a handle
    of a pool chunk would name other bytes."""
    import cupy
    pooled = cupy.arange(1000, dtype=cupy.float32)  # the memory pool holds a chunk from now on
    values = (np.arange(24, dtype=np.uint16) * 2311).reshape(4, 6)
    region = cuda_shm.CudaShmRegion("colibri_test", values.nbytes + 16, 0)
    try:
        region.write(cupy.asarray(values))
        opened = subprocess.run([sys.executable, "-c", OPEN_IN_ANOTHER_PROCESS, region.raw_handle.decode(),
                                 str(values.nbytes)], capture_output=True, text=True, timeout=120)
        assert opened.returncode == 0, opened.stderr[-3000:]
        assert bytes.fromhex(opened.stdout) == values.tobytes()
        back = region.read(np.uint16, values.shape)
        assert isinstance(back, cupy.ndarray) and np.array_equal(back.get(), values)
        with pytest.raises(ValueError):
            region.write(cupy.zeros(region.nbytes + 1, cupy.uint8))
    finally:
        region.free()
        del pooled


# --- what a host without a GPU or cupy is told, in one line ----------------------------------------

CLIENT = REPO_ROOT / "client" / "cuda_shm_client.py"


def without_cupy(folder):
    """The environment of a host without cupy, whatever this one has: PYTHONPATH starts with a folder
    whose cupy fails to import, leaving the file `imported` there (whether anything asked for it)."""
    (folder / "cupy").mkdir(parents=True)
    (folder / "cupy" / "__init__.py").write_text(
        f"open({str(folder / 'imported')!r}, 'w').close()\nraise ImportError('cupy is hidden by the test')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def expected_without_cupy():
    """(the line for this host without cupy, whether cupy is asked for): no driver is said before."""
    driver = cuda_shm.nvidia_driver()
    if driver is None:
        return "needs a CUDA GPU, and this host has no NVIDIA driver", False
    return f"needs cupy: {cuda_shm.cupy_advice(driver)}", True


def test_cuda_shm_client_without_gpu_or_cupy_says_so_in_one_line(tmp_path):
    """No driver: that, before cupy is asked for. A driver without cupy: which cupy to install for it.
    One line, exit 2, before the checkpoint is looked for."""
    env = without_cupy(tmp_path / "hidden")
    result = subprocess.run([sys.executable, str(CLIENT), "--weights", str(tmp_path / "absent.colibri.safetensors")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    message, cupy_asked = expected_without_cupy()
    assert result.stderr.splitlines() == [f"cuda_shm_client: {message}"], result.stderr
    assert result.stdout == ""
    assert (tmp_path / "hidden" / "imported").exists() == cupy_asked


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="needs locust (not imported here: it "
                    "patches the standard library for gevent)")
def test_cudashm_user_without_gpu_or_cupy_stops_the_run_in_one_line(tmp_path):
    """The locustfile imports without cupy (GrpcUser and HttpUser run in the compose image, which has no
    GPU); asking for CudaShmUser there stops the run at once with the same line and status 2."""
    env = without_cupy(tmp_path / "hidden")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "locust", "-f", "locustfile.py", "CudaShmUser", "--headless",
                             "-u", "1", "-t", "5s", "--host", f"http://127.0.0.1:{port}"],
                            cwd=REPO_ROOT / "loadtest", capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    message, _ = expected_without_cupy()
    ours = [line for line in result.stderr.splitlines() if line.startswith("loadtest:")]
    assert ours == [f"loadtest: CudaShmUser {message}"] and "Traceback" not in result.stderr, result.stderr
