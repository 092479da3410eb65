"""A stand-in for tritonserver, for the watchdog's tests: serves colibri_moe's config and answers
infer requests (binary extension) with the input as the output, on --http-port. While the file
broken-<its pid> exists in its working directory it answers every infer as tritonserver 2.51 does
with a dead Python-backend stub (HTTP 500), and its ready endpoint still says 200. A file
fail-next-start makes the next start exit 3 at once (and is removed): a start that fails."""
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

H = 8
CONFIG = {"name": "colibri_moe", "max_batch_size": 4096,
          "input": [{"name": "hidden_states", "data_type": "TYPE_FP32", "dims": [H]}],
          "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [H]}]}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status, body, headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v2/models/colibri_moe/config":
            self.answer(200, json.dumps(CONFIG).encode())
        elif self.path.startswith("/v2/health/"):
            self.answer(200, b"")
        else:
            self.answer(404, b'{"error":"not found"}')

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if os.path.exists(f"broken-{os.getpid()}"):
            return self.answer(500, b'{"error":"Stub process \'colibri_moe_0_0\' is not healthy."}')
        raw = body[int(self.headers["Inference-Header-Content-Length"]):]
        header = json.dumps({"outputs": [{"name": "output", "datatype": "FP32", "shape": [1, H],
                                          "parameters": {"binary_data_size": len(raw)}}]}).encode()
        self.answer(200, header + raw, [("Inference-Header-Content-Length", str(len(header)))])


def main():
    if os.path.exists("fail-next-start"):
        os.unlink("fail-next-start")
        sys.exit(3)
    port = int(next(a for a in sys.argv if a.startswith("--http-port=")).split("=", 1)[1])
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open("starts.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
