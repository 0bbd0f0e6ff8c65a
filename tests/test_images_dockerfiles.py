"""Container images, checked without a Docker engine (none is available to the test suite).

The Dockerfiles are parsed and checked statically: version build args, each image installing only
its own extra, non-root users where required, entrypoints that exist. The build context is
reproduced with Docker's .dockerignore rules and a wheel is really built from it, so a context that
lacks something the build needs fails here; the wheel's metadata then shows what each extra pulls
in (the operator and node images must not get torch).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
EXTRAS = {"operator.Dockerfile": "operator", "node-agent.Dockerfile": "node", "runtime.Dockerfile": "train"}
ENTRYPOINTS = {"operator.Dockerfile": "kareus-operator", "node-agent.Dockerfile": "kareus-node"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to; -1 before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    instructions, stage = [], -1
    for line in logical:
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        instructions.append(Instruction(keyword.upper(), args.strip(), stage))
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


DOCKERFILES = {path.name: parse_dockerfile(path.read_text()) for path in sorted(IMAGES.glob("*.Dockerfile"))}


def test_one_dockerfile_per_image():
    assert set(DOCKERFILES) == set(EXTRAS)


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_versions_are_build_args_and_every_from_uses_them(name):
    instructions = DOCKERFILES[name]
    global_args = {i.args.split("=")[0] for i in instructions if i.keyword == "ARG" and i.stage == -1}
    assert "BASE_IMAGE" in global_args
    assert {"PYTHON_VERSION"} <= global_args or {"TORCH_VERSION", "CUDA_VERSION"} <= global_args
    for i in instructions:
        if i.keyword == "FROM":
            image = i.args.split()[0]
            assert image.startswith("${"), f"{name}: FROM {image} is not a build arg"
            assert set(re.findall(r"\$\{(\w+)\}", image)) <= global_args
        if i.keyword == "ARG" and "=" in i.args:
            assert i.args.split("=", 1)[1], f"{name}: ARG {i.args} has an empty default"
    labels = " ".join(i.args for i in final_stage(instructions) if i.keyword == "LABEL")
    assert 'org.opencontainers.image.version="${KAREUS_VERSION}"' in labels
    assert any(i.keyword == "ARG" and i.args.startswith("KAREUS_VERSION=") for i in final_stage(instructions))


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_each_image_installs_only_its_extra(name):
    runs = " ".join(i.args for i in DOCKERFILES[name] if i.keyword == "RUN")
    installs = [i for i in re.findall(r"pip install ([^&;]+)", runs)]
    extras = [e for i in installs for e in re.findall(r"\.\[([\w,-]+)\]", i)]
    assert extras == [EXTRAS[name]], installs
    assert not any("nvidia" in i for i in installs)
    if name != "runtime.Dockerfile":
        assert len(installs) == 1 and "torch" not in installs[0]
        assert "find_spec('torch') is not None" in runs  # the build fails if torch sneaks in


def test_the_runtime_image_carries_exactly_the_pinned_torch_and_checks_itself():
    """torch from requirements/torch.txt (the one pin `make install` uses too), in a layer before the
    code; the extra resolved against that pin; at build time the entrypoint starts, torch is the pinned
    version and `new_group` takes `device_id` (torch >= 2.6)."""
    pin = (ROOT / "requirements" / "torch.txt").read_text()
    assert re.search(r"^torch==\d+\.\d+\.\d+$", pin, re.MULTILINE)
    assert "-r $(TORCH_PIN)" in (ROOT / "Makefile").read_text() and "TORCH_PIN := requirements/torch.txt" in (
        ROOT / "Makefile").read_text()
    instructions = DOCKERFILES["runtime.Dockerfile"]
    runs = [i.args for i in instructions if i.keyword == "RUN"]
    installs = [re.findall(r"pip install ([^&;]+)", run) for run in runs]
    assert [i.strip() for i in installs[0]] == ["--no-compile -r requirements/torch.txt"]
    assert any("-c requirements/torch.txt \".[train]\"" in i for i in installs[1])
    assert any("--no-deps ." in i for i in installs[2])
    checks = runs[2]
    assert "kareus --help" in checks and "requirements/torch.txt" in checks and "'device_id'" in checks
    keywords = [(i.keyword, i.args.split()[0]) for i in instructions if i.keyword in ("COPY", "RUN")]
    assert keywords.index(("COPY", "requirements/torch.txt")) < keywords.index(("COPY", "kareus"))


def test_images_run_as_the_users_the_pods_ask_for():
    """runAsUser of the pods the chart and the operator create is each image's USER, and that user exists."""
    from kareus_operator import manifests

    values = yaml.safe_load((ROOT / "helm" / "kareus" / "values.yaml").read_text())
    operator_pod = values["operator"]["podSecurityContext"]
    assert user_of("operator.Dockerfile") == f"{operator_pod['runAsUser']}:{operator_pod['runAsGroup']}"
    worker = manifests._RESTRICTED_POD
    assert user_of("runtime.Dockerfile") == f"{worker['runAsUser']}:{worker['runAsGroup']}"
    for name in ("operator.Dockerfile", "runtime.Dockerfile"):
        uid = user_of(name).split(":")[0]
        runs = " ".join(i.args for i in final_stage(DOCKERFILES[name]) if i.keyword == "RUN")
        assert f":x:{uid}:" in runs  # an /etc/passwd entry: getpass and kopf look the uid up


def user_of(name: str) -> str:
    users = [i.args for i in final_stage(DOCKERFILES[name]) if i.keyword == "USER"]
    assert users, f"{name}: the final stage sets no USER"
    return users[-1]


@pytest.mark.parametrize("name", ["operator.Dockerfile", "runtime.Dockerfile"])
def test_operator_and_runtime_run_as_numeric_non_root(name):
    uid, _, gid = user_of(name).partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0)


def test_node_agent_is_root_by_design_and_gets_nvml_from_the_host():
    assert user_of("node-agent.Dockerfile") == "0:0"
    env = " ".join(i.args for i in final_stage(DOCKERFILES["node-agent.Dockerfile"]) if i.keyword == "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in env and "NVIDIA_VISIBLE_DEVICES=all" in env
    text = (IMAGES / "node-agent.Dockerfile").read_text()
    assert "libnvidia-ml" not in " ".join(i.args for i in DOCKERFILES["node-agent.Dockerfile"] if i.keyword == "RUN")
    assert "host driver" in text


def test_operator_image_suits_a_read_only_root_filesystem():
    env = " ".join(i.args for i in final_stage(DOCKERFILES["operator.Dockerfile"]) if i.keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env


@pytest.mark.parametrize("name", sorted(ENTRYPOINTS))
def test_entrypoints_are_console_scripts_the_chart_runs(name):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    [entrypoint] = [i.args for i in final_stage(DOCKERFILES[name]) if i.keyword == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == [ENTRYPOINTS[name]]
    assert ENTRYPOINTS[name] in scripts
    template = "operator-deployment.yaml" if name.startswith("operator") else "node-agent-daemonset.yaml"
    assert f'command: ["{ENTRYPOINTS[name]}"]' in (ROOT / "helm" / "kareus" / "templates" / template).read_text()


# ---------------------------------------------------------------- the build context


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore pattern (Go filepath.Match plus `**`) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out, i = out[:-2] + "(?:.*/)?", i + 1
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "$")


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        rules.append((negate, _pattern_regex(pattern)))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for negate, regex in rules:
        if any(regex.match(p) for p in prefixes):
            verdict = not negate
    return verdict


def context_files() -> list[str]:
    rules = dockerignore_rules()
    try:  # a checkout: the files git knows (a local .venv or build output never counts)
        files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [f for f in files if (ROOT / f).is_file() and not excluded(f, rules)]


def test_dockerignore_matcher_follows_docker_rules():
    rules = [(False, _pattern_regex("*")), (True, _pattern_regex("kareus")), (False, _pattern_regex("**/*.pyc"))]
    assert excluded("tests/test_x.py", rules) and excluded(".venv/bin/python", rules)
    assert not excluded("kareus/policy.py", rules)
    assert excluded("kareus/sub/x.pyc", rules)


def test_context_holds_the_sources_and_nothing_else():
    files = context_files()
    tops = {f.split("/")[0] for f in files}
    assert {"pyproject.toml", "kareus", "operator", "node_daemon"} <= tops
    assert tops <= {"pyproject.toml", "README.md", "LICENSE", "kareus", "operator", "node_daemon", "requirements"}
    assert "kareus/policy.py" in files and "node_daemon/kareus_node/main.py" in files
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)
    for name, instructions in DOCKERFILES.items():
        for i in instructions:
            if i.keyword == "COPY" and not i.args.startswith("--from"):
                source = i.args.split()[0]
                assert any(f == source or f.startswith(source + "/") for f in files), f"{name}: COPY {source}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel really built (pip, setuptools) from exactly the files Docker would send."""
    context = tmp_path_factory.mktemp("context")
    for f in context_files():
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, context / f)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(context), "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out)], check=True, capture_output=True, timeout=300)
    [built] = out.glob("kareus-*.whl")
    return built


def requirements(wheel: Path) -> dict[str | None, set[str]]:
    """Requirement names by extra (None: always installed), from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    by_extra: dict[str | None, set[str]] = {}
    for line in lines:
        if line.startswith("Requires-Dist:"):
            spec = line.removeprefix("Requires-Dist:").strip()
            name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()
            extra = re.search(r"extra == ['\"]([\w-]+)['\"]", spec)
            by_extra.setdefault(extra.group(1) if extra else None, set()).add(name)
    return by_extra


def test_wheel_from_the_context_has_every_package_and_entry_point(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kareus/policy.py" in names and "kareus_operator/main.py" in names and "kareus_node/main.py" in names
    for script in ("kareus", "kareus-operator", "kareus-node"):
        assert re.search(rf"^{script} = ", entry_points, re.MULTILINE), script


def test_operator_and_node_images_get_no_torch(wheel):
    needs = requirements(wheel)
    core = needs[None]
    for extra in ("operator", "node"):
        assert "torch" not in core | needs[extra]
    assert "nvidia-ml-py" not in core | needs["operator"]
    assert "kopf" not in core | needs["node"]
    assert "torch" in needs["train"]
