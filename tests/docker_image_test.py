#!/usr/bin/env python3
"""Checks deploy/Dockerfile without Docker, against this checkout and the binaries built here.

  tests/docker_image_test.py REPO BUILD_DIR NAME=BINARY... [--cuda=ON|OFF]

- The targets manager, agent and tools exist, run as uid 10001, carry an OCI title label,
  and their ENTRYPOINT is a binary copied into the image.
- Every COPY from the context names a path that exists, and no tracked file under it is
  excluded by .dockerignore.
- Every file copied out of a build stage's CMake build directory is a target that stage
  builds (`--target`), at the path CMake puts it (checked against BINARY under BUILD_DIR).
- Every `docker build ... --target NAME` in deploy/README.md and the Dockerfile (and each NAME of
  deploy/README.md's `for target in ...` loop) is a stage.
- For each image, every shared library its binaries load directly (ELF NEEDED, resolved by
  ldd here, owner by dpkg -S) comes from a package its apt-get install lines name, or from
  debian:12-slim itself. CUDA and NCCL, which are not Debian packages here, must come from
  NVIDIA's packages for the same major version (cuda-cudart-MAJOR-MINOR, libnccl2).
A kvcm-agent built without CUDA (--cuda=OFF) has no CUDA or NCCL library to check; the test
then says so and checks the rest.
"""

from __future__ import annotations

import os
import re
import shlex
from functools import lru_cache
import subprocess
import sys
from pathlib import Path

IMAGES = ("manager", "agent", "tools")
UID = "10001"
# Packages of debian:12-slim that the binaries load from (Priority: required; always there).
SLIM_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
# Libraries that no Debian package provides here, and the NVIDIA package that must.
NVIDIA_LIBRARIES = [
    (re.compile(r"libcudart\.so\.(\d+)$"), "cuda-cudart-{}-"),  # cuda-cudart-13-0
    (re.compile(r"libnccl\.so\.(\d+)$"), "libnccl{}"),  # libnccl2
]

failures: list[str] = []


def fail(message: str) -> None:
    failures.append(message)
    print("FAIL:", message)


class Stage:
    def __init__(self, name: str, base: str):
        self.name, self.base = name, base
        self.args: dict[str, str] = {}
        self.instructions: list[tuple[str, str]] = []  # (INSTRUCTION, rest)
        self.packages: set[str] = set()  # apt-get install, this stage only
        self.files: dict[str, str] = {}  # basename copied in -> source stage
        self.build_dir: str | None = None  # cmake -B
        self.targets: set[str] = set()  # cmake --build --target


def logical_lines(text: str) -> list[str]:
    """Dockerfile instructions: comment lines dropped, backslash continuations joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    return lines


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)


def parse_dockerfile(path: Path) -> dict[str, Stage]:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in logical_lines(path.read_text()):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG":
            name, _, default = rest.strip().partition("=")
            default = default.strip('"')
            if stage is None:
                global_args[name] = default
            else:
                stage.args[name] = default if "=" in rest else global_args.get(name, "")
            continue
        if instruction == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", rest.strip(), re.IGNORECASE)
            if not m:
                fail(f"FROM without a stage name: {line}")
                continue
            stage = Stage(m.group(2), m.group(1))
            stages[stage.name] = stage
            continue
        if stage is None:
            continue
        rest = expand(rest, stage.args)
        stage.instructions.append((instruction, rest))
        if instruction == "RUN":
            parse_run(stage, rest)
        elif instruction == "COPY":
            words = shlex.split(rest)
            source = next((w[7:] for w in words if w.startswith("--from=")), None)
            if source:
                for src in [w for w in words if not w.startswith("--")][:-1]:
                    stage.files[os.path.basename(src.rstrip("/"))] = source
    return stages


def parse_run(stage: Stage, command: str) -> None:
    # Shell variables the Dockerfile derives from an ARG: cuda=$(echo "13.0" | tr . -).
    for var, value in re.findall(r'(\w+)=\$\(echo "([^"]*)" \| tr \. -\)', command):
        command = re.sub(r"\$\{?" + var + r"\b\}?", value.replace(".", "-"), command)
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, commands = [], []
    for token in list(lexer) + [";"]:
        if token in ("&&", "||", ";", "|", "(", ")", "$("):
            commands.append(words)
            words = []
        elif not re.fullmatch(r"\w+=\S*", token) or words:  # VAR=value before a command
            words.append(token)
    for words in commands:
        if words[:2] == ["apt-get", "install"]:
            stage.packages |= {w.split("=")[0] for w in words[2:] if not w.startswith("-")}
        if words[:1] == ["cmake"] and "-B" in words and "--build" not in words:
            stage.build_dir = words[words.index("-B") + 1]
        if words[:2] == ["cmake", "--build"] and "--target" in words:
            stage.targets |= set(words[words.index("--target") + 1 :])


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = []
    while name in stages:
        chain.append(stages[name])
        name = stages[name].base
    return chain


def dockerignore_patterns(repo: Path) -> list[tuple[bool, re.Pattern]]:
    patterns = []
    path = repo / ".dockerignore"
    if not path.exists():
        fail(".dockerignore is missing")
        return patterns
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern):
            if part.startswith("**"):
                regex += "(?:.*/)?" if part.endswith("/") else ".*"
            elif part == "*":
                regex += "[^/]*"
            elif part == "?":
                regex += "[^/]"
            else:
                regex += re.escape(part)
        patterns.append((negate, re.compile(regex + "$")))
    return patterns


def ignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern that matches the path or a parent directory wins."""
    parts = path.strip("/").split("/")
    result = False
    for negate, regex in patterns:
        if any(regex.match("/".join(parts[: i + 1])) for i in range(len(parts))):
            result = not negate
    return result


def tracked_files(repo: Path, source: str) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "--", source],
                             capture_output=True, text=True, check=True).stdout
        return out.split()
    except (OSError, subprocess.CalledProcessError):
        return []


def check_context_copies(repo: Path, stages: dict[str, Stage]) -> None:
    patterns = dockerignore_patterns(repo)
    for stage in stages.values():
        for instruction, rest in stage.instructions:
            if instruction not in ("COPY", "ADD") or "--from=" in rest:
                continue
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            for src in words[:-1]:
                if re.match(r"https?://", src):
                    continue
                if not (repo / src).exists():
                    fail(f"{stage.name}: COPY {src}: no such path in the repository")
                    continue
                if ignored(src, patterns):
                    fail(f"{stage.name}: COPY {src}: excluded by .dockerignore")
                excluded = [f for f in tracked_files(repo, src) if ignored(f, patterns)]
                if excluded:
                    fail(f"{stage.name}: COPY {src}: .dockerignore excludes {excluded[:5]}")


def check_stage_copies(stages: dict[str, Stage], build_dir: Path,
                       binaries: dict[str, Path]) -> None:
    for stage in stages.values():
        for instruction, rest in stage.instructions:
            if instruction != "COPY" or "--from=" not in rest:
                continue
            words = shlex.split(rest)
            source = stages.get(next(w[7:] for w in words if w.startswith("--from=")))
            if source is None or source.build_dir is None:
                continue
            for src in [w for w in words if not w.startswith("--")][:-1]:
                if not src.startswith(source.build_dir + "/"):
                    continue
                name = os.path.basename(src)
                if name not in source.targets:
                    fail(f"{stage.name}: COPY {src}: stage {source.name} builds only "
                         f"{sorted(source.targets)}")
                if name in binaries:
                    want = os.path.relpath(binaries[name], build_dir)
                    got = os.path.relpath(src, source.build_dir)
                    if want != got:
                        fail(f"{stage.name}: COPY {src}: CMake puts {name} at {want}")


def check_image(stages: dict[str, Stage], name: str) -> None:
    chain = lineage(stages, name)
    text = {i: r for s in reversed(chain) for i, r in s.instructions}  # nearest wins
    if text.get("USER", "").split(":")[0] != UID:
        fail(f"{name}: USER is not {UID}")
    labels = " ".join(r for s in chain for i, r in s.instructions if i == "LABEL")
    for label in ("title", "description", "version", "revision"):
        if f"org.opencontainers.image.{label}=" not in labels:
            fail(f"{name}: no org.opencontainers.image.{label} label")
    entrypoint = re.findall(r'"([^"]+)"', text.get("ENTRYPOINT", ""))
    files = {f for s in chain for f in s.files}
    if entrypoint and os.path.basename(entrypoint[0]) not in files:
        fail(f"{name}: ENTRYPOINT {entrypoint[0]} is not copied into the image")
    if not entrypoint and "CMD" not in text:
        fail(f"{name}: neither ENTRYPOINT nor CMD")


def check_documented_targets(repo: Path, stages: dict[str, Stage]) -> None:
    for doc in ("deploy/README.md", "deploy/Dockerfile"):
        text = (repo / doc).read_text()
        builds = "\n".join(line for line in text.splitlines() if "docker build" in line)
        names = re.findall(r"--target\s+(\w[\w-]*)", builds)
        for loop in re.findall(r"for target in ([\w -]+);", text):
            names += loop.split()
        for name in names:
            if name not in stages:
                fail(f"{doc}: --target {name}: no such stage in deploy/Dockerfile")


def needed_libraries(binary: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def resolved_paths(binary: Path) -> dict[str, str]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s*(\S+) => (\S+)", out, re.MULTILINE))


@lru_cache(maxsize=None)
def debian_package(path: str) -> str | None:
    candidates = [path, os.path.realpath(path)]
    candidates += [re.sub(r"^/lib", "/usr/lib", p) for p in candidates]
    for candidate in candidates:
        result = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if result.returncode == 0:
            return result.stdout.split(":")[0].strip()
    return None


def check_libraries(stages: dict[str, Stage], name: str, binaries: dict[str, Path],
                    cuda: bool) -> None:
    chain = lineage(stages, name)
    packages = set().union(*(s.packages for s in chain))
    copied = [f for s in chain for f in s.files if f in binaries]
    if not copied:
        fail(f"{name}: copies none of the binaries built here ({sorted(binaries)})")
    for binary_name in copied:
        binary = binaries[binary_name]
        paths = resolved_paths(binary)
        providers = set()
        for soname in needed_libraries(binary):
            path = paths.get(soname)
            if path is None or path == "not":
                fail(f"{name}: {binary_name} needs {soname}, which ldd does not find here")
                continue
            package = debian_package(path)
            if package is not None:
                if package not in packages and package not in SLIM_PACKAGES:
                    fail(f"{name}: {binary_name} needs {soname} from {package}, which the "
                         f"image does not install (it installs {sorted(packages)})")
                providers.add(package)
                continue
            for regex, prefix in NVIDIA_LIBRARIES:
                m = regex.match(soname)
                if m:
                    want = prefix.format(m.group(1))
                    if not any(p.startswith(want) for p in packages):
                        fail(f"{name}: {binary_name} needs {soname}: the image installs no "
                             f"{want}* (it installs {sorted(packages)})")
                    providers.add(want + "*")
                    break
            else:
                fail(f"{name}: {binary_name} needs {soname} ({path}), which no Debian or "
                     "NVIDIA package known to this test provides")
        print(f"{name}: {binary_name} loads libraries from {sorted(providers)}")
        if binary_name == "kvcm-agent" and not cuda:
            print(f"note {name}: kvcm-agent was built here without CUDA; its CUDA runtime "
                  "and NCCL libraries are not checked")


def main() -> int:
    repo, build_dir = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    binaries, cuda = {}, False
    for arg in sys.argv[3:]:
        if arg.startswith("--cuda="):
            cuda = arg.split("=", 1)[1].upper() in ("ON", "TRUE", "1")
        else:
            name, _, path = arg.partition("=")
            binaries[name] = Path(path)
    stages = parse_dockerfile(repo / "deploy" / "Dockerfile")
    for image in IMAGES:
        if image not in stages:
            fail(f"no stage {image} (docker build --target {image})")
    check_context_copies(repo, stages)
    check_documented_targets(repo, stages)
    check_stage_copies(stages, build_dir, binaries)
    for image in IMAGES:
        if image in stages:
            check_image(stages, image)
            check_libraries(stages, image, binaries, cuda)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
