"""Serving colibri_moe with Triton: the `colibri serve` launcher (launcher.py), the liveness probe and
watchdog (watchdog.py), what the Python backend's model reads from its config (triton_config.py), the
served checkpoint's identity (identity.py), how model.py joins a batch's requests (batching.py), and
CUDA shared memory for clients (cuda_shm.py). The engine never imports this package; model.py and the
runtime modules here stay importable on Python 3.8 (tests/test_py38.py), the launcher needs 3.10+.
Nothing is imported here: each module is loaded only when asked for."""
