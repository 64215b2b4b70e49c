"""The served soak: a bounded load with faults on one shared-KV server, and its verdict.

``scripts/glm5_cp_hicache_soak.py`` drives it (docs/gpu.md, "Soak"). What lives here runs without a GPU:

* the plan (``build_soak_plan``): multi-turn conversations over long shared prefixes, sized from
  the server's *logical* device pool D (``max_total_num_tokens``) and host pool H = ratio x D.
  Conversations are visited in rounds, one turn each, in a fresh order per round: by the time a
  conversation comes back, every other one has passed, so its prefix was evicted from device
  (written to host first: load-back) and, since all conversations together hold about 1.5 x H,
  often from host too (recomputed). A prompt is at most D / (2 x clients), so every client's
  request fits beside the others'. Some items are faults: a client that disconnects during
  prefill or during decode, a request aborted through ``/abort_request`` after its first token,
  and every ``flush_every``-th item a ``/flush_cache`` (refused while requests run: counted;
  every other one waits for the running requests to end first: ``SoakLoad``);
* one client's action for an item (``run_generate``, ``run_flush``; ``SoakLoad`` runs the clients)
  and a request's outcome (``RequestOutcome``);
* the sample of requests whose KV the pool audit dumps (``audited``: every turn of some
  conversations), which the driver checks against itself (``kv_audit_compare.layer0_self_consistency``);
* the cross-rank tree comparison (``compare_tree_dumps``) of the dumps the smoke plugin's
  ``tree_dump`` hook writes whenever ``/server_info`` reaches the schedulers (every rank handles
  that request at the same scheduler step, so their trees must be identical there);
* the verdict (``soak_failures``): no server error, every rank alive, the KV audits clean, the
  value audit within the recorded stock tolerance (no stock server runs beside the soak), the
  trees identical, no request lost.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_shared_kv_testing.e2e.server_process import stream_chunks

GENERATE, FLUSH = "generate", "flush"
NO_FAULT = "none"
DISCONNECT_PREFILL = "disconnect-prefill"  # the client closes the stream before the first token
DISCONNECT_DECODE = "disconnect-decode"  # the client closes the stream after a few tokens
ABORT_REQUEST = "abort-request"  # POST /abort_request {rid} after the first token
FAULTS = (DISCONNECT_PREFILL, DISCONNECT_DECODE, ABORT_REQUEST)
# Outcome statuses: answered in full, aborted by the client (cleanly: no error, no 5xx), or lost.
FINISHED, ABORTED, ERROR = "finished", "aborted", "error"
# Tree dump files of the smoke plugin (``tree_dump.py``): tree.rank<r>.<seq>.json
TREE_DUMP_GLOB = "tree.rank*.json"
MAX_TURNS = 4
# The smoke plugin dumps the pool rows of the requests whose rid matches AUDITED_RID_PATTERN
# (``SMOKE_AUDIT_POOL_ENV``): a sample, since every request's dump would fill the disk.
AUDITED_RID_SUFFIX = "-audit"
AUDITED_RID_PATTERN = AUDITED_RID_SUFFIX + "$"


@dataclass(frozen=True)
class SoakItem:
    index: int
    kind: str  # GENERATE or FLUSH
    conversation: int = -1
    turn: int = -1
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    fault: str = NO_FAULT
    audited: bool = False  # its KV is dumped for the pool self-consistency audit (rid ends AUDITED_RID_SUFFIX)

    @property
    def rid(self) -> str:
        return f"soak-{self.index}-c{self.conversation}t{self.turn}" + (AUDITED_RID_SUFFIX if self.audited else "")


@dataclass(frozen=True)
class SoakPlan:
    logical_device_tokens: int
    logical_host_tokens: int
    page_size: int
    clients: int
    prefix_tokens: int  # shared by every turn of a conversation
    turn_tokens: int  # each turn appends this many
    turns: int
    conversations: int
    token_id_low: int
    token_id_high: int
    seed: int
    items: List[SoakItem] = field(default_factory=list)

    @property
    def conversation_tokens(self) -> int:
        """Logical tokens a conversation's last turn leaves in the tree (its prompt)."""
        return self.prefix_tokens + self.turns * self.turn_tokens

    def input_ids(self, item: SoakItem) -> List[int]:
        """Turn t of conversation c: its prefix, then turn blocks 0..t (so turn t extends turn t-1)."""
        ids = self._tokens((self.seed, item.conversation, "prefix"), self.prefix_tokens)
        for t in range(item.turn + 1):
            ids += self._tokens((self.seed, item.conversation, t), self.turn_tokens)
        return ids

    def _tokens(self, key: tuple, count: int) -> List[int]:
        rng = random.Random(repr(key))
        return [rng.randrange(self.token_id_low, self.token_id_high) for _ in range(count)]

    def describe(self) -> List[str]:
        requests = [i for i in self.items if i.kind == GENERATE]
        faults = {f: sum(1 for i in requests if i.fault == f) for f in FAULTS}
        lines = [
            f"logical device D={self.logical_device_tokens} host H={self.logical_host_tokens} tokens; "
            f"{self.clients} clients; {self.conversations} conversations x {self.turns} turns "
            f"(prefix {self.prefix_tokens} + {self.turn_tokens} per turn = {self.conversation_tokens} tokens, "
            f"{self.conversations * self.conversation_tokens} in all = "
            f"{self.conversations * self.conversation_tokens / self.logical_host_tokens:.2f} x H)",
            f"{len(self.items)} items: {len(requests)} requests "
            f"({', '.join(f'{n} {f}' for f, n in faults.items())}), "
            f"{sum(1 for i in self.items if i.kind == FLUSH)} flushes, {sum(i.audited for i in requests)} "
            f"requests audited (pool dumps); seed={self.seed}",
        ]
        for item in self.items[:12]:
            what = "flush_cache" if item.kind == FLUSH else (
                f"c{item.conversation} t{item.turn} prompt={item.prompt_tokens} new={item.max_new_tokens} {item.fault}"
            )
            lines.append(f"  #{item.index:<4} {what}")
        if len(self.items) > 12:
            lines.append(f"  ... {len(self.items) - 12} more")
        return lines


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple


def build_soak_plan(
    logical_device_tokens: int,
    hicache_ratio: float,
    *,
    page_size: int = 64,
    clients: int = 8,
    max_items: int = 2000,
    max_new_tokens: int = 16,
    decode_fault_new_tokens: int = 96,
    fault_fraction: float = 0.15,
    flush_every: int = 50,
    host_overfill: float = 1.5,
    audit_every: int = 8,
    token_id_range: Tuple[int, int] = (0, 256),
    seed: int = 0,
) -> SoakPlan:
    """The items of a soak against a server of ``logical_device_tokens`` (see the module docstring).

    ``fault_fraction`` of the requests carry a fault, split evenly over ``FAULTS``; the plan is the
    same for the same arguments (``seed``). The requests without a fault of every ``audit_every``-th
    conversation are ``audited`` (0: none): their turns share prefixes, served from device or host."""
    if hicache_ratio <= 1:
        raise ValueError(f"--hicache-ratio must be > 1 (sglang requires host > device), got {hicache_ratio}")
    if clients < 1 or max_items < 1 or flush_every < 2:
        raise ValueError(
            f"need --clients >= 1, --max-requests >= 1 and --flush-every >= 2 (got {clients}, {max_items}, {flush_every})"
        )
    if not 0 <= fault_fraction <= 1:
        raise ValueError(f"--fault-fraction {fault_fraction} is not in [0, 1]")
    low, high = token_id_range
    if not 0 <= low < high:
        raise ValueError(f"bad token id range [{low}, {high})")
    device = logical_device_tokens
    host = math.floor(hicache_ratio * device)
    longest_new = _round_down(max(max_new_tokens, decode_fault_new_tokens) + page_size - 1, page_size)
    prompt_cap = _round_down(device // (2 * clients) - longest_new, page_size)
    if prompt_cap < 2 * page_size:
        raise ValueError(
            f"a device of {device} logical tokens is too small for --clients {clients} with "
            f"{longest_new} new tokens each (every prompt must fit D / (2 x clients)): raise "
            "--physical-tokens-per-rank or lower --clients"
        )
    # Half the longest prompt is the shared prefix, the other half up to MAX_TURNS whole-page turns.
    prefix = _round_down(prompt_cap // 2, page_size)
    turns = max(1, min(MAX_TURNS, (prompt_cap - prefix) // page_size))
    turn_tokens = _round_down((prompt_cap - prefix) // turns, page_size)
    conversation_tokens = prefix + turns * turn_tokens
    conversations = max(2 * clients, math.ceil(host_overfill * host / conversation_tokens))
    rng = random.Random(seed)
    items: List[SoakItem] = []
    round_index = 0
    while len(items) < max_items:
        turn = round_index % turns
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            if len(items) >= max_items:
                break
            if (len(items) + 1) % flush_every == 0:
                items.append(SoakItem(index=len(items), kind=FLUSH))
                if len(items) >= max_items:
                    break
            fault = FAULTS[rng.randrange(len(FAULTS))] if rng.random() < fault_fraction else NO_FAULT
            new_tokens = decode_fault_new_tokens if fault in (DISCONNECT_DECODE, ABORT_REQUEST) else max_new_tokens
            items.append(
                SoakItem(
                    index=len(items), kind=GENERATE, conversation=c, turn=turn,
                    prompt_tokens=prefix + (turn + 1) * turn_tokens, max_new_tokens=new_tokens, fault=fault,
                    audited=bool(audit_every) and c % audit_every == 0 and fault == NO_FAULT,
                )
            )  # fmt: skip
        round_index += 1
    return SoakPlan(
        logical_device_tokens=device, logical_host_tokens=host, page_size=page_size, clients=clients,
        prefix_tokens=prefix, turn_tokens=turn_tokens, turns=turns, conversations=conversations,
        token_id_low=low, token_id_high=high, seed=seed, items=items,
    )  # fmt: skip


# ---------------------------------------------------------------- one client's action


@dataclass
class RequestOutcome:
    index: int
    fault: str
    status: str  # FINISHED, ABORTED or ERROR
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    http_status: Optional[int] = None
    detail: str = ""


def _finish_type(chunk: Dict) -> Optional[str]:
    reason = (chunk.get("meta_info") or {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def run_generate(base_url: str, plan: SoakPlan, item: SoakItem, timeout_s: float, rng: random.Random) -> RequestOutcome:
    """Send one planned request, inflict its fault, and say how it ended.

    A request without a fault must return ``max_new_tokens`` tokens. One the client disconnected is
    ABORTED unless the server answered an error first. One aborted through ``/abort_request`` must
    end with sglang's abort finish reason (or finish normally, the abort having come too late)."""
    import requests

    payload = {
        "input_ids": plan.input_ids(item),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": item.max_new_tokens, "ignore_eos": True},
        "stream": True,
        "rid": item.rid,
    }
    out = RequestOutcome(item.index, item.fault, ERROR, item.prompt_tokens)
    disconnect_after = {DISCONNECT_PREFILL: 0, DISCONNECT_DECODE: 1 + rng.randrange(8)}.get(item.fault)
    aborted = False
    last: Dict = {}
    try:
        with requests.post(base_url + "/generate", json=payload, stream=True, timeout=timeout_s) as response:
            out.http_status = response.status_code
            if response.status_code != 200:
                out.detail = f"HTTP {response.status_code}: {response.text[:300]}"
                return out
            if disconnect_after == 0:
                time.sleep(rng.uniform(0.0, 0.05))  # somewhere in its prefill (or still queued)
                out.status = ABORTED
                return out  # leaving the block closes the connection
            for chunk in stream_chunks(response):
                if "error" in chunk:
                    message = str(chunk["error"])
                    out.status = ABORTED if aborted and "abort" in message.lower() else ERROR
                    out.detail = message[:300]
                    return out
                last = chunk
                out.output_tokens = len(chunk.get("output_ids") or [])
                if disconnect_after is not None and out.output_tokens >= disconnect_after:
                    out.status = ABORTED
                    return out
                if item.fault == ABORT_REQUEST and not aborted:
                    aborted = True
                    answer = requests.post(base_url + "/abort_request", json={"rid": item.rid}, timeout=timeout_s)
                    if answer.status_code >= 500:  # a server error, counted with the request's
                        out.http_status = answer.status_code
    except requests.RequestException as e:
        out.detail = f"{type(e).__name__}: {e}"[:300]
        return out
    meta = last.get("meta_info") or {}
    out.cached_tokens = int(meta.get("cached_tokens") or 0)
    out.cached_host_tokens = int((meta.get("cached_tokens_details") or {}).get("host") or 0)
    if aborted and _finish_type(last) == "abort":
        out.status = ABORTED
    elif out.output_tokens == item.max_new_tokens and _finish_type(last) != "abort":
        out.status = FINISHED
    else:
        out.detail = f"{out.output_tokens} of {item.max_new_tokens} tokens, finish_reason {_finish_type(last)!r}"
    return out


def run_flush(base_url: str, timeout_s: float) -> str:
    """``ok``, ``refused`` (sglang flushes only an idle server: any 4xx answer) or ``error`` (5xx, none)."""
    import requests

    try:
        status = requests.post(base_url + "/flush_cache", timeout=timeout_s).status_code
    except requests.RequestException:
        return "error"
    return "ok" if status == 200 else ("refused" if 400 <= status < 500 else "error")


class SoakLoad:
    """``clients`` threads take the plan's items in order until the plan or the time runs out.

    Flushes alternate between two kinds. A plain one is sent while the other clients go on (sglang
    refuses it unless the server happens to be idle). A quiesced one first stops the other clients
    from taking items and waits (at most ``QUIESCE_S``) until no request runs, then flushes at once:
    the requests are done but their host writes and load-backs may still be in flight, which the
    flush must survive (``CpHiRadixCache.reset``). Before every flush, ``checkpoint`` (the driver's
    tree dump) runs."""

    QUIESCE_S = 30.0

    def __init__(self, base_url: str, plan: SoakPlan, duration_s: float, timeout_s: float, checkpoint=None):
        self.base_url, self.plan, self.timeout_s = base_url, plan, timeout_s
        self.deadline = time.monotonic() + duration_s
        self.checkpoint = checkpoint
        self.lock = threading.Condition()
        self.next_item = 0
        self.paused = False  # a quiesced flush is waiting for the running requests to end
        self.in_flight = self.max_in_flight = 0
        self.outcomes: List[RequestOutcome] = []
        self.flushes: Dict[str, int] = {"ok": 0, "refused": 0, "error": 0}
        self.flushes_quiesced = 0
        self.elapsed_s = 0.0

    def _take(self) -> Optional[SoakItem]:
        with self.lock:
            self.lock.wait_for(lambda: not self.paused or time.monotonic() >= self.deadline, timeout=self.QUIESCE_S)
            if self.next_item >= len(self.plan.items) or time.monotonic() >= self.deadline:
                return None
            self.next_item += 1
            return self.plan.items[self.next_item - 1]

    def _flush(self, quiesced: bool) -> None:
        if quiesced:
            with self.lock:
                self.paused = True
                self.lock.wait_for(lambda: self.in_flight == 0, timeout=self.QUIESCE_S)
        answer = "error"
        try:
            if self.checkpoint is not None:
                self.checkpoint()
            answer = run_flush(self.base_url, self.timeout_s)
        finally:
            with self.lock:
                self.flushes[answer] += 1
                self.flushes_quiesced += quiesced
                self.paused = False
                self.lock.notify_all()

    def _client(self, number: int) -> None:
        rng = random.Random(f"{self.plan.seed}/client{number}")
        while (item := self._take()) is not None:
            if item.kind == FLUSH:
                self._flush(quiesced=sum(1 for i in self.plan.items[: item.index] if i.kind == FLUSH) % 2 == 1)
                continue
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            outcome = run_generate(self.base_url, self.plan, item, self.timeout_s, rng)
            with self.lock:
                self.in_flight -= 1
                self.outcomes.append(outcome)
                self.lock.notify_all()

    def run(self) -> "SoakLoad":
        start = time.monotonic()
        threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(self.plan.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.elapsed_s = time.monotonic() - start
        return self


# ---------------------------------------------------------------- load figures


def load_summary(outcomes: Sequence[RequestOutcome], flushes: Dict[str, int], max_in_flight: int, elapsed_s: float) -> Dict:
    """What the soak held and inflicted (the report's and the table's figures)."""
    by_status = {s: sum(1 for o in outcomes if o.status == s) for s in (FINISHED, ABORTED, ERROR)}
    return {
        "requests_sent": len(outcomes),
        **by_status,
        "faults": {f: sum(1 for o in outcomes if o.fault == f) for f in FAULTS},
        "aborted_by_fault": {f: sum(1 for o in outcomes if o.fault == f and o.status == ABORTED) for f in FAULTS},
        "prompt_tokens_sent": sum(o.prompt_tokens for o in outcomes),
        "output_tokens_received": sum(o.output_tokens for o in outcomes),
        "host_hit_tokens": sum(o.cached_host_tokens for o in outcomes),
        "requests_with_host_hits": sum(1 for o in outcomes if o.cached_host_tokens > 0),
        "max_concurrency": max_in_flight,
        "flushes": {"ok": 0, "refused": 0, "error": 0, **flushes},  # every answer, none without a load
        "http_5xx": sum(1 for o in outcomes if o.http_status is not None and o.http_status >= 500)
        + flushes.get("error", 0),
        "elapsed_s": round(elapsed_s, 1),
    }


# ---------------------------------------------------------------- tree dumps across ranks


def tree_dump_path(tree_dir: Path, rank: int, seq: int) -> Path:
    return Path(tree_dir) / f"tree.rank{rank}.{seq:04d}.json"


def tree_dumps_by_seq(tree_dir: Path) -> Dict[int, Dict[int, dict]]:
    """{seq: {rank: dump}} of the finished dump files (the hook renames a file once written)."""
    found: Dict[int, Dict[int, dict]] = {}
    for path in sorted(Path(tree_dir).glob(TREE_DUMP_GLOB)):
        _, rank, seq, _ = path.name.split(".")
        found.setdefault(int(seq), {})[int(rank[len("rank"):])] = json.loads(path.read_text())
    return found


def next_tree_dump_seq(tree_dir: Path) -> int:
    """The number the next dump will carry: one past the highest any rank wrote (or 0)."""
    seqs = [int(path.name.split(".")[2]) for path in Path(tree_dir).glob(TREE_DUMP_GLOB)]
    return max(seqs) + 1 if seqs else 0


def wait_for_tree_dump(tree_dir: Path, ranks: int, seq: int, timeout_s: float) -> bool:
    """True once every rank wrote dump ``seq``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(tree_dump_path(tree_dir, r, seq).exists() for r in range(ranks)):
            return True
        time.sleep(0.2)
    return False


def first_difference(a, b, where: str = "") -> Optional[str]:
    """Where two JSON values first differ (a path and both values, shortened), None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}: present on one side only"
            diff = first_difference(a[key], b[key], f"{where}.{key}")
            if diff:
                return diff
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{where}[{i}]")
            if diff:
                return diff
        return None if len(a) == len(b) else f"{where}: {len(a)} vs {len(b)} entries"
    return None if a == b else f"{where}: {json.dumps(a)[:200]} vs {json.dumps(b)[:200]}"


def compare_tree_dumps(tree_dir: Path, ranks: int) -> Tuple[int, List[str]]:
    """(checkpoints compared, failures): at every checkpoint every rank's ``shared`` part (tree
    shape, logical locs, host lengths, lock refs, evictable sizes, the host-slot ledger) must equal
    rank 0's, and every rank must have written it."""
    dumps = tree_dumps_by_seq(tree_dir)
    if not dumps:
        return 0, [f"tree dumps: none in {tree_dir}"]
    failures = []
    for seq, by_rank in sorted(dumps.items()):
        missing = [r for r in range(ranks) if r not in by_rank]
        if missing:
            failures.append(f"tree dump {seq}: ranks {missing} wrote none")
            continue
        for rank in range(1, ranks):
            diff = first_difference(by_rank[0]["shared"], by_rank[rank]["shared"])
            if diff:
                failures.append(f"tree dump {seq}: rank {rank} differs from rank 0 at {diff}")
    return len(dumps), failures


# ---------------------------------------------------------------- verdict


@dataclass
class SoakEvidence:
    """Everything the verdict judges, gathered by the driver after the load."""

    summary: Dict
    outcomes: List[RequestOutcome]
    log_failures: List[str]  # smoke_report.log_failures of the server log
    health_ok: bool  # /health_generate answered 200 after the load
    schedulers_alive: int
    schedulers_expected: int
    audit_failures: List[str]  # the smoke's audits' judgements (kv_audit_compare, decode_read_audit, values)
    tree_checkpoints: int
    tree_failures: List[str]
    idle_failures: List[str] = field(default_factory=list)  # requests still running or queued after the load
    hicache_failures: List[str] = field(default_factory=list)  # smoke_report.hicache_failures
    skipped: List[str] = field(default_factory=list)  # checks not run (a fake server)

    def to_json(self) -> Dict:
        return asdict(self)


def lost_request_failures(outcomes: Sequence[RequestOutcome]) -> List[str]:
    lost = [o for o in outcomes if o.status == ERROR]
    if not lost:
        return []
    return [f"{len(lost)} of {len(outcomes)} requests lost (neither answered nor cleanly aborted); first: "
            f"#{lost[0].index} ({lost[0].fault}) {lost[0].detail}"]  # fmt: skip


def soak_failures(e: SoakEvidence) -> List[str]:
    failures = []
    if not e.outcomes:
        failures.append("no request was sent")
    if e.summary.get("http_5xx"):
        failures.append(f"{e.summary['http_5xx']} server errors (HTTP 5xx)")
    failures += lost_request_failures(e.outcomes)
    failures += e.log_failures
    if not e.health_ok:
        failures.append("/health_generate did not answer 200 after the load")
    if e.schedulers_alive != e.schedulers_expected:
        failures.append(f"{e.schedulers_alive} of {e.schedulers_expected} scheduler processes alive at the end")
    failures += e.audit_failures
    if "tree dumps" not in e.skipped and not e.tree_checkpoints and not e.tree_failures:
        failures.append("tree dumps: no checkpoint compared")
    failures += e.tree_failures
    failures += e.idle_failures
    failures += e.hicache_failures
    return failures


def table_row(name: str, summary: Dict, tree_checkpoints: int, decode: str, failures: List[str]) -> str:
    """One row of docs/gpu.md's soak table (``summary``: ``load_summary`` and the HiCache figures;
    ``decode``: what the server logged, ``ServedDecode.describe``)."""
    s = summary
    faults = s["aborted_by_fault"]
    return (
        f"| {name} | {s['requests_sent']} ({s['finished']} / {s['aborted']} / {s['error']}) | "
        f"{s['prompt_tokens_sent']:,} / {s['output_tokens_received']:,} | {s['max_concurrency']} | "
        f"{faults[DISCONNECT_PREFILL]} / {faults[DISCONNECT_DECODE]} / {faults[ABORT_REQUEST]} | "
        f"{s['flushes']['ok']} / {s['flushes']['refused']} | {s.get('evicted_tokens', 0):,.0f} / "
        f"{s.get('load_back_tokens', 0):,.0f} | {tree_checkpoints} | {decode} | "
        f"{'PASS' if not failures else 'FAIL'} |"
    )


TABLE_HEADER = (
    "| run | requests (finished / aborted / lost) | prompt / output tokens | max concurrency | "
    "aborts prefill / decode / endpoint | flushes done / refused | evicted / loaded back tokens | "
    "tree checkpoints | decode (served) | verdict |\n|---|---|---|---|---|---|---|---|---|---|"
)
