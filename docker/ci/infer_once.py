"""One HTTP/JSON inference request to a served colibri_moe (python stdlib only): reads H from the
model's metadata, sends T tokens, and checks that the answer is [T, H], FP32 and finite; prints the
checkpoint the model's config names (COLIBRI_CHECKPOINT_* parameters).
    python3 docker/ci/infer_once.py [http://127.0.0.1:8000] [T]"""
import json
import math
import random
import sys
import urllib.request

url = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4
model = f"{url}/v2/models/colibri_moe"

with urllib.request.urlopen(model, timeout=30) as reply:
    metadata = json.load(reply)
hidden = next(i for i in metadata["inputs"] if i["name"] == "hidden_states")
width = hidden["shape"][-1]
assert width > 0, f"hidden_states has no fixed width in the metadata: {hidden}"

with urllib.request.urlopen(f"{model}/config", timeout=30) as reply:
    parameters = json.load(reply).get("parameters", {})
served = {key[len("COLIBRI_CHECKPOINT_"):]: value["string_value"] for key, value in parameters.items()
          if key.startswith("COLIBRI_CHECKPOINT_")}
assert len(served.get("SHA256", "")) == 64, f"the config does not name the checkpoint served: {sorted(parameters)}"
print(f"infer_once: serving {served['FILE']} ({served['BYTES']} bytes, sha256 {served['SHA256']}, "
      f"demo: {served['DEMO']})")

rng = random.Random(0)
body = {"inputs": [{"name": "hidden_states", "shape": [tokens, width], "datatype": "FP32",
                    "data": [rng.uniform(-1, 1) for _ in range(tokens * width)]}],
        "outputs": [{"name": "output"}]}
request = urllib.request.Request(f"{model}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as reply:
    answer = json.load(reply)
output = answer["outputs"][0]
values = output["data"]
assert output["name"] == "output" and output["datatype"] == "FP32", output
assert output["shape"] == [tokens, width], f"shape {output['shape']}, expected {[tokens, width]}"
assert len(values) == tokens * width, f"{len(values)} values for shape {output['shape']}"
assert all(math.isfinite(v) for v in values), "output is not finite"
assert any(v != 0 for v in values), "output is all zeros"
print(f"infer_once: {url} answered [{tokens}, {width}] FP32, finite, max |y| = {max(map(abs, values)):.4g}")
