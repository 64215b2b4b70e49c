"""The frozen facts of shared KV on one server: ``CpSharedKVSpec``, built once per model runner.

Everything the runtime, per-owner decode, the CP HiCache and the PD manager must agree on is
decided once, where the capacity is installed (``cp_shared_kv_capacity``, before sglang sizes the
pool), and handed to them rather than recomputed: the layout (``CpSharedKVLayout``, which the
allocator carries), the settings read once in this process, the decode path and its reason, and
the gather scratch's decision. The MTP draft's runner reuses the target's spec. Every input is the
same on every rank (server args, the context length, the inherited environment, the CP group), so
every rank builds the same spec.

After the spec is built nothing in the process reads the environment again: per-forward code asks
the spec (``test_module_structure`` pins who reads the settings).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings import CpSharedKVSettings, current_settings
from sglang_cp_shared_kv.startup_rules import (
    DecodePath,
    ScratchDecision,
    decide_decode_path,
    decide_scratch,
    runtime_problems,
)


@dataclass(frozen=True)
class CpSharedKVSpec:
    """``layout``: which rank stores which page; ``settings``: this process's settings, read once;
    ``decode``: per owner or the page gather, and why; ``scratch``: the gather scratch's slots."""

    layout: CpSharedKVLayout
    settings: CpSharedKVSettings
    decode: DecodePath
    scratch: ScratchDecision

    @property
    def scratch_serves_decode(self) -> bool:
        """Slot 0 holds the logical capacity, so decode forwards may gather (False: sized for
        prefill batches only, decode runs per owner)."""
        return not self.scratch.slot0.prefill_only


def build_spec(server_args, context_len: int, cp_size: int, cp_rank: int) -> CpSharedKVSpec:
    """The spec of this model runner: the settings read, the runtime's startup rules judged (again
    in this process, with the decode path decided once for both) and every decision taken.
    ``ValueError`` naming the flags for what the runtime cannot serve."""
    settings = current_settings()
    decode = decide_decode_path(server_args, settings)
    problems = runtime_problems(server_args, settings, decode)
    if problems:
        raise ValueError("; ".join(problems))
    return CpSharedKVSpec(
        layout=CpSharedKVLayout(cp_size, cp_rank, server_args.page_size),
        settings=settings,
        decode=decode,
        scratch=decide_scratch(server_args, settings, decode, context_len),
    )
