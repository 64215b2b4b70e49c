"""Two shared-KV servers on one Mooncake Store: the plan, the store's expected objects, the verdict.

``scripts/glm5_cp_l3_shared_store_smoke.py`` runs it. One store (a ``mooncake_master`` and the
holder, a ``mooncake_client`` mounting the only segment: ``sglang_cp_shared_kv_testing/mooncake_master.py``),
three servers with HiCache, the two shared-KV ones storing to the store and mounting no segment:

  a          shared KV at CP ``tp_a``: serves ``prefixes`` prompts of ``prefix_tokens`` (rids
             ``store-a-write-<k>``); each rank stores the pages it owns when their host copy is
             acknowledged. Stopped after B's first round.
  b          shared KV at CP ``tp_b``, started once every page of A's is in the holder: each prefix
             plus a suffix while A is up (``store-b-live-<k>``), then, after A stopped and B's own
             device and host tiers were flushed, each prefix plus another suffix
             (``store-b-after-<k>``). Every one of those prefixes must come from L3, whole.
  reference  stock sglang (replicated KV, no storage) at CP ``tp_b``: the same ``store-b-*`` prompts,
             recomputed (flushed between the rounds as B is). Its pool dumps are the reference of
             B's layer-0 rows, its value audit the tolerance of A's and B's, its TTFT the recomputed
             side of the comparison.

With a router (``router_prefixes`` > 0), between B's rounds: ``sglang_router`` in front of A and B
(round robin), and for each router prefix ``j`` the prefix alone (``store-router-write-<j>``), then,
once its pages are in the holder, the prefix plus a suffix (``store-router-read-<j>``). Which server
served each is read from the servers' prompt-token counters; a read served by the server that did
not compute its prefix must come from L3, whole.

Prefix 0 warms up B and the reference; prefixes 1.. are timed. All counts are logical tokens.
The store's objects: two per page (the KV object, the indexer object), under owner-free keys
(``<namespace tag>_<page hash>``, the tag as the servers log it); every one of A's must be in the
holder's segment, before and after A stopped, and no server may mount a segment of its own.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang_cp_shared_kv_testing.e2e.l3_restart import TIMING_LABEL, L3RestartPlan, ServedRequest, decode_text

A, B, REFERENCE = "a", "b", "reference"
SHARED_KV_SERVERS = (A, B)
# The second suffix of prefix k is drawn from stream AFTER_STREAM + k, beyond every prompt stream
# (L3RestartPlan draws prefix k from 2k and its first suffix from 2k + 1).
AFTER_STREAM = 1 << 20
# sglang 0.5.11's MooncakeStore stores an MLA page's KV as f"{key}_{mla_suffix}_k"
# (``_get_mla_buffer_meta``) and its indexer page as f"{key}_{mla_suffix}_{PoolName.INDEXER}"
# (``_get_hybrid_page_component_keys``), mla_suffix "" on one pipeline stage and no
# ``extra_backend_tag`` in the extra config.
OBJECT_SUFFIXES = ("__k", "__indexer")
# The startup line of every storing rank (``CpHiRadixCache._build_storage``) names the key prefix.
NAMESPACE_TAG_LINE = re.compile(r"CP HiCache L3 storage mooncake on cp rank \d+ of \d+ .*: keys (cpkv[0-9a-f]+)_<page hash>")


@dataclass(frozen=True)
class SharedStorePlan(L3RestartPlan):
    """The prompts of the three servers and the router (deterministic from ``seed``)."""

    router_prefixes: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.router_prefixes < 0:
            raise ValueError(f"--router-prefixes {self.router_prefixes}: need 0 or more")

    def live_prompt(self, k: int) -> List[int]:
        """Prefix ``k`` and a suffix, to B while A is up."""
        return self.read_prompt(k)

    def after_prompt(self, k: int) -> List[int]:
        """Prefix ``k`` and another suffix, to B after A stopped."""
        return self.write_prompt(k) + self._tokens(AFTER_STREAM + k, self.suffix_tokens)

    def router_write_prompt(self, j: int) -> List[int]:
        return self.write_prompt(self.prefixes + j)

    def router_read_prompt(self, j: int) -> List[int]:
        return self.read_prompt(self.prefixes + j)

    @staticmethod
    def write_rid(k: int) -> str:
        return f"store-a-write-{k}"

    @staticmethod
    def live_rid(k: int) -> str:
        return f"store-b-live-{k}"

    @staticmethod
    def after_rid(k: int) -> str:
        return f"store-b-after-{k}"

    @staticmethod
    def router_write_rid(j: int) -> str:
        return f"store-router-write-{j}"

    @staticmethod
    def router_read_rid(j: int) -> str:
        return f"store-router-read-{j}"

    def describe(self) -> List[str]:
        lines = [
            f"a:         {self.prefixes} prompts of {self.prefix_tokens} tokens (rids store-a-write-0..{self.prefixes - 1}); "
            f"each page's KV and indexer objects must reach the holder ({2 * self.stored_pages()} objects)",
            f"b (A up):  the same prefixes + {self.suffix_tokens} new tokens each (rids store-b-live-*), "
            f"expected from L3: {self.prefix_tokens} tokens each",
            f"b (A stopped, B flushed): the same prefixes + {self.suffix_tokens} other tokens (rids store-b-after-*), "
            f"expected from L3: {self.prefix_tokens} tokens each",
            "reference: stock, no storage: the same store-b-* prompts, flushed between the rounds (pool "
            "reference, value tolerance, TTFT)",
            f"timed: prefixes {list(self.timed())} (prefix 0 warms up B and the reference)",
        ]
        if self.router_prefixes:
            lines.append(
                f"router (A and B up, round robin): {self.router_prefixes} new prefixes of {self.prefix_tokens} "
                "tokens (store-router-write-*), each then with a suffix (store-router-read-*): a read on the "
                "server that did not compute its prefix must come from L3, whole"
            )
        return lines


# ---------------------------------------------------------------- the store's objects


def namespace_tags(log_lines: Sequence[str]) -> List[str]:
    """The key prefixes a server's storing ranks logged (one per rank, all equal on a sound server)."""
    return [m.group(1) for m in map(NAMESPACE_TAG_LINE.search, log_lines) if m]


def page_object_keys(tag: str, tokens: Sequence[int], page_size: int) -> List[str]:
    """The store's object keys of ``tokens``' whole pages: per page key (``storage_keys``:
    ``<tag>_<page hash>``) its KV object and its indexer object."""
    from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import page_hash_chain

    keys = [f"{tag}_{page_hash}" for page_hash in page_hash_chain(tokens, page_size)]
    return [key + suffix for key in keys for suffix in OBJECT_SUFFIXES]


def store_failures(when: str, expected: Sequence[str], endpoints: Dict[str, List[str]], holder_endpoint: str,
                   segment_endpoints: Sequence[str]) -> List[str]:  # fmt: skip
    """The store ``when`` (e.g. "after a stopped"): every expected object held, each only in the
    holder's segment, and no segment mounted but the holder's."""
    failures = []
    others = sorted(set(segment_endpoints) - {holder_endpoint})
    if others:
        failures.append(f"store ({when}): segments mounted besides the holder's: {others} (a server with a "
                        "segment of its own keeps what the master places there, and takes it along when it stops)")  # fmt: skip
    missing = [key for key in expected if not endpoints.get(key)]
    if missing:
        failures.append(f"store ({when}): {len(missing)} of {len(expected)} objects missing (first {missing[0]})")
    elsewhere = [key for key in expected if endpoints.get(key) and set(endpoints[key]) != {holder_endpoint}]
    if elsewhere:
        failures.append(f"store ({when}): {len(elsewhere)} of {len(expected)} objects have a replica outside the "
                        f"holder's segment (first {elsewhere[0]}: {endpoints[elsewhere[0]]})")  # fmt: skip
    return failures


# ---------------------------------------------------------------- which server the router chose


def served_by(prompt_tokens: int, counters_before: Dict[str, float], counters_after: Dict[str, float]) -> Optional[str]:
    """The server whose prompt-token counter grew by ``prompt_tokens`` across one request sent alone
    (None: none did, or more than one did)."""
    grown = [name for name in counters_after if counters_after[name] - counters_before.get(name, 0) == prompt_tokens]
    return grown[0] if len(grown) == 1 else None


# ---------------------------------------------------------------- the verdict


def hit_failures(plan: SharedStorePlan, requests: Sequence[ServedRequest]) -> List[str]:
    """B's prompts: the whole prefix from L3 in both rounds. A's: nothing from L3 (a fresh store).
    The reference's: nothing cached (fresh, flushed between the rounds, no storage)."""
    failures = [f"{r.server} {r.rid}: {r.error}" for r in requests if r.error]
    by = {(r.server, r.rid): r for r in requests}
    for k in range(plan.prefixes):
        write = by.get((A, plan.write_rid(k)))
        if write is None:
            failures.append(f"a {plan.write_rid(k)}: no response")
        elif write.storage_tokens:
            failures.append(f"a {write.rid}: {write.storage_tokens} tokens from L3 on a fresh store")
        for rid, when in ((plan.live_rid(k), "with A up"), (plan.after_rid(k), "after A stopped")):
            read = by.get((B, rid))
            if read is None:
                failures.append(f"b {rid}: no response")
            elif not read.error and (read.storage_tokens or 0) != plan.prefix_tokens:
                failures.append(f"b {rid} ({when}): {read.storage_tokens or 0} tokens served from L3, expected the "
                                f"whole prefix of {plan.prefix_tokens} (cached {read.cached_tokens} in all)")  # fmt: skip
            ref = by.get((REFERENCE, rid))
            if ref is None:
                failures.append(f"reference {rid}: no response")
            elif not ref.error and ref.cached_tokens:
                failures.append(f"reference {rid}: {ref.cached_tokens} cached tokens, expected 0 (fresh or flushed)")
    return failures


def router_failures(plan: SharedStorePlan, requests: Sequence[ServedRequest]) -> List[str]:
    """Through the router: each pair's read on the other server than its write, whole from L3
    there; a request whose server is unknown fails (``served_by``)."""
    if not plan.router_prefixes:
        return []
    by = {r.rid: r for r in requests if r.rid.startswith("store-router-")}
    failures = []
    for j in range(plan.router_prefixes):
        write, read = by.get(plan.router_write_rid(j)), by.get(plan.router_read_rid(j))
        if write is None or read is None:
            failures.append(f"router pair {j}: no response ({'write' if write is None else 'read'})")
            continue
        failures += [f"router {r.rid}: {r.error}" for r in (write, read) if r.error]
        if write.error or read.error:
            continue
        if not {write.server, read.server} <= set(SHARED_KV_SERVERS):
            failures.append(f"router pair {j}: served by {write.server} then {read.server}: not both known")
        elif write.server == read.server:
            failures.append(f"router pair {j}: both requests went to {read.server}, so none read another "
                            "server's prefix (round robin expected)")  # fmt: skip
        elif (read.storage_tokens or 0) != plan.prefix_tokens:
            failures.append(f"router {read.rid} on {read.server}: {read.storage_tokens or 0} tokens from L3, expected "
                            f"the prefix {write.server} computed ({plan.prefix_tokens})")  # fmt: skip
    return failures


def restored_pairs(plan: SharedStorePlan) -> List[Tuple[str, str, int]]:
    """(rid on A, rid on B, tokens restored) of every B prompt: ``restored_row_check``'s pairs."""
    pairs = []
    for k in range(plan.prefixes):
        pairs += [(plan.write_rid(k), plan.live_rid(k), plan.prefix_tokens),
                  (plan.write_rid(k), plan.after_rid(k), plan.prefix_tokens)]  # fmt: skip
    return pairs


def l3_hit_rate(plan: SharedStorePlan, requests: Sequence[ServedRequest]) -> Dict[str, Any]:
    """Tokens B read from L3 over the tokens of the prefixes it was sent, per round."""
    by = {(r.server, r.rid): r for r in requests}
    out: Dict[str, Any] = {}
    for round_name, rid_of in (("with_a_up", plan.live_rid), ("after_a_stopped", plan.after_rid)):
        tokens = [(by[(B, rid_of(k))].storage_tokens or 0) if (B, rid_of(k)) in by else 0 for k in range(plan.prefixes)]
        out[round_name] = {"l3_tokens": tokens, "rate": round(sum(tokens) / (plan.prefixes * plan.prefix_tokens), 4)}
    return out


def ttft_comparison(plan: SharedStorePlan, requests: Sequence[ServedRequest]) -> Dict[str, Any]:
    """Median TTFT over the timed prefixes: B from L3 (per round) vs the reference recomputing."""
    by = {(r.server, r.rid): r for r in requests}

    def median_of(server: str, rid_of) -> Optional[float]:
        values = [by[(server, rid_of(k))].ttft_ms for k in plan.timed() if (server, rid_of(k)) in by]
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    return {
        "label": TIMING_LABEL,
        "prefix_tokens": plan.prefix_tokens,
        "timed_prefixes": len(plan.timed()),
        "from_l3_a_up_ms": median_of(B, plan.live_rid),
        "from_l3_a_stopped_ms": median_of(B, plan.after_rid),
        "recomputed_ms": median_of(REFERENCE, plan.after_rid),
    }


def run_name(tp_a: int, tp_b: int) -> str:
    return f"l3_shared_store_a{tp_a}_b{tp_b}"


def verdict_line(tp_a: int, tp_b: int, failures: Sequence[str], figures: Dict[str, Any]) -> str:
    """One line for a reader of a GPU call's tail, naming the decode A and B logged."""
    decode = decode_text(figures.get("decode", {}))
    name = run_name(tp_a, tp_b)
    if failures:
        return f"FAILED {name}, {decode}: {len(failures)} failures, first: {failures[0][:300]}"
    hits = figures.get("l3_hit_rate", {})
    restored = figures.get("restored_rows", {})
    ttft = figures.get("ttft", {})
    router = figures.get("router")
    return (
        f"PASSED {name}, {decode}: B's prefixes from L3 {hits.get('with_a_up', {}).get('rate')} with A up, "
        f"{hits.get('after_a_stopped', {}).get('rate')} after A stopped; restored rows "
        f"{restored.get('positions_differing', '?')} differing / {restored.get('positions_checked', '?')}; "
        f"{figures.get('objects_in_holder', '?')} objects in the holder after A stopped; pool "
        f"{figures.get('pool_audit_wrong_rows', '?')} wrong rows / {figures.get('pool_audit_positions', '?')}; "
        f"values max {figures.get('value_max', '?')} (tolerance {figures.get('value_tolerance_max', '?')}); "
        + (f"router: {router}; " if router else "")
        + f"TTFT ({ttft.get('label')}) from L3 {ttft.get('from_l3_a_stopped_ms')} ms vs recomputed "
        f"{ttft.get('recomputed_ms')} ms"
    )
