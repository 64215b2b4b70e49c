"""Find, by trying imports, which distributions a GPU job needs beyond the GPU machine's image.

Runs here (CPU, with sglang 0.5.11 installed). Each round imports the GPU job's modules in a fresh
interpreter that sees only a view of site-packages holding the distributions of the GPU image
(``gpu_image_packages.txt``) and those staged so far. A hard import that fails names the next
distribution to stage; soft imports (``try: import x except ImportError``, ``find_spec`` probes)
find nothing, as on the GPU machine, and are not staged. Prints ``name==version`` (the version
installed here) per staged distribution, seeds first; build_stage.sh keeps that list in
``stage_requirements.txt``.

CPU caveat: code behind ``if is_cuda()`` is not imported here; the GPU smoke
(``smoke_hicache_gpu.py``) is what proves the set complete there.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import pathlib
import re
import shutil
import site
import subprocess
import sys
import sysconfig

REPO = pathlib.Path(__file__).resolve().parents[2]
GPU_IMAGE_LIST = pathlib.Path(__file__).with_name("gpu_image_packages.txt")

# Always staged: sglang itself, its kernel package (staged as a trimmed tarball, see build_stage.sh),
# the transformers/tokenizers pair sglang 0.5.11 works with (the image's transformers 5.17 fails on
# sglang's config registration), and tvm-ffi, which the JIT HiCache kernel needs only on CUDA.
SEED_DISTRIBUTIONS = (
    "sglang",
    "sglang-kernel",
    "transformers",
    "tokenizers",
    "apache-tvm-ffi",
)

# What a GPU job of ours imports: sglang's pools, host pools and HiCache controllers, the plugin
# framework, and every module of our package.
TARGET_MODULES = (
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.hiradix_cache",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.server_args",
    "sglang.srt.layers.dp_attention",
    "sglang.jit_kernel.hicache",
)
OUR_PACKAGE = "sglang_cp_shared_kv"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_image_distributions() -> set[str]:
    lines = GPU_IMAGE_LIST.read_text().splitlines()
    return {normalize(line) for line in lines if line.strip() and not line.startswith("#")}


def our_modules() -> list[str]:
    root = REPO / "python" / OUR_PACKAGE
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def owners_by_path(site_packages: pathlib.Path) -> dict[str, set[str]]:
    """For every path prefix under site-packages, the distributions that own files below it."""
    owners: dict[str, set[str]] = {}
    for dist in metadata.distributions(path=[str(site_packages)]):
        name = normalize(dist.metadata["Name"])
        for file in dist.files or ():
            parts = pathlib.PurePosixPath(file).parts
            if not parts or parts[0] == "..":
                continue
            for depth in range(1, len(parts) + 1):
                owners.setdefault("/".join(parts[:depth]), set()).add(name)
    return owners


def build_view(
    site_packages: pathlib.Path,
    owners: dict[str, set[str]],
    available: set[str],
    view: pathlib.Path,
) -> None:
    """A site directory of symlinks showing only files of available distributions.

    A hidden distribution is then absent the way it is on the GPU machine: no module, no metadata,
    so ``importlib.util.find_spec`` and ``importlib.metadata`` probes answer "not installed".
    Directories shared by available and hidden distributions (namespace packages) are rebuilt one
    level deeper; files owned by no distribution (caches) are shown.
    """
    if view.exists():
        shutil.rmtree(view)
    view.mkdir(parents=True)

    def place(rel: str) -> None:
        for entry in sorted((site_packages / rel).iterdir()):
            key = f"{rel}/{entry.name}" if rel else entry.name
            entry_owners = owners.get(key, set())
            if entry_owners and not entry_owners & available:
                continue
            if entry_owners <= available or not entry.is_dir():
                (view / key).symlink_to(entry)
            else:
                (view / key).mkdir()
                place(key)

    place("")


def child(view: str) -> None:
    """One round (run with ``python -S``): import the targets from the view, report the first miss."""
    site.addsitedir(view)
    sys.path.insert(0, str(REPO / "python"))

    from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

    sgl_kernel_cpu_shim.install()
    report = {"missing": None, "other_errors": []}
    for module in list(TARGET_MODULES) + our_modules():
        try:
            importlib.import_module(module)
        except Exception as exc:
            missing = _missing_module_in_chain(exc)
            if missing is not None and not missing.startswith(OUR_PACKAGE):
                report["missing"] = missing
                break
            # A module of ours still in progress, say: not a staging question.
            report["other_errors"].append(f"{module}: {exc!r}")
    print("PROBE_REPORT " + json.dumps(report))


def _missing_module_in_chain(exc: BaseException) -> str | None:
    """Name of the module whose absence caused ``exc``, also behind wrappers such as transformers'
    lazy-module errors (which re-raise with another message)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            return exc.name
        exc = exc.__cause__ or exc.__context__
    return None


def probe(view: pathlib.Path) -> list[str]:
    site_packages = pathlib.Path(sysconfig.get_paths()["purelib"])
    dist_of_top = metadata.packages_distributions()
    owners = owners_by_path(site_packages)
    image = gpu_image_distributions()
    staged = [normalize(d) for d in SEED_DISTRIBUTIONS]
    while True:
        build_view(site_packages, owners, image | set(staged), view)
        out = subprocess.run(
            [sys.executable, "-S", __file__, "--child", str(view)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        line = next(l for l in out.splitlines() if l.startswith("PROBE_REPORT "))
        report = json.loads(line[len("PROBE_REPORT ") :])
        missing = report["missing"]
        top = (missing or "").split(".")[0]
        new = [normalize(d) for d in dist_of_top.get(top, ()) if normalize(d) not in staged]
        if missing is not None and not new:
            raise SystemExit(f"stage_probe: {missing} is missing and no installed distribution has it")
        if missing is None:
            for error in report["other_errors"]:
                print(f"stage_probe: not a staging question: {error}", file=sys.stderr)
            return staged
        print(f"stage_probe: {missing} -> stage {new}", file=sys.stderr)
        staged.extend(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--view", default="/tmp/sglang_cp_gpu_stage_view", help="scratch site dir")
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    for dist in probe(pathlib.Path(args.view)):
        print(f"{dist}=={metadata.version(dist)}")


if __name__ == "__main__":
    main()
