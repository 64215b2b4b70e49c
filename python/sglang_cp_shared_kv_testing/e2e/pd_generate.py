"""One greedy request through a PD pair without a router, and the pair's TTFT / TPOT.

sglang 0.5.11 ships no PD load balancer (it lives in the separate sgl-router), so the smoke does what
one does: send the same ``/generate`` request to the prefill and the decode server at once, both
carrying the prefill's bootstrap address and one random ``bootstrap_room``. The prefill computes the
prompt and its first token and pushes the KV to the decode's pages; the decode streams the tokens.

Timings are taken on the client from the decode stream: TTFT = request sent -> first streamed token
chunk; TPOT = (last chunk - first chunk) / (tokens - 1).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from sglang_cp_shared_kv_testing.e2e.server_process import LOOPBACK, GenerateResult, stream_chunks

MAX_BOOTSTRAP_ROOM = 2**63 - 1


@dataclass
class PDGenerateResult(GenerateResult):
    tpot_s: Optional[float] = None
    prefill_meta_info: Optional[Dict[str, Any]] = None
    decode_meta_info: Optional[Dict[str, Any]] = None  # the decode stream's last (MTP counts are the decode's)


def generate_greedy_pd(
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    input_ids: List[int],
    max_new_tokens: int,
    timeout_s: float,
    rng: Optional[random.Random] = None,
    rid: Optional[str] = None,
) -> PDGenerateResult:
    """The same greedy request to both servers; tokens and timings from the decode stream.

    ``rid`` names the request on both servers (the KV audit's dump files are named by it)."""
    import requests

    room = (rng or random.SystemRandom()).randrange(MAX_BOOTSTRAP_ROOM)
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "bootstrap_host": LOOPBACK,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    if rid is not None:
        payload["rid"] = rid
    prefill: Dict[str, Any] = {}

    def post_prefill():
        try:
            response = requests.post(prefill_url + "/generate", json=payload, timeout=timeout_s)
            prefill["status"] = response.status_code
            prefill["body"] = response.json() if response.status_code == 200 else response.text[:500]
        except (requests.RequestException, ValueError) as e:
            prefill["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=post_prefill, daemon=True)
    start = time.perf_counter()
    thread.start()
    ttft = last_chunk_at = None
    last: Dict[str, Any] = {}
    error = None
    try:
        with requests.post(
            decode_url + "/generate", json={**payload, "stream": True}, stream=True, timeout=timeout_s
        ) as response:
            if response.status_code != 200:
                error = f"decode HTTP {response.status_code}: {response.text[:500]}"
            else:
                for chunk in stream_chunks(response):
                    if "error" in chunk:
                        error = f"decode: {chunk['error']}"
                        break
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    last_chunk_at = now
                    last = chunk
    except (requests.RequestException, ValueError) as e:
        error = f"decode {type(e).__name__}: {e}"
    e2e = time.perf_counter() - start
    thread.join(timeout_s)
    if error is None and "error" in prefill:
        error = f"prefill {prefill['error']}"
    elif error is None and prefill.get("status") != 200:
        error = f"prefill HTTP {prefill.get('status')}: {prefill.get('body')}"
    output_ids = list(last.get("output_ids", []))
    if error is None and not last:
        error = "no output chunk from decode"
    tpot = None
    if ttft is not None and last_chunk_at is not None and len(output_ids) > 1:
        tpot = (last_chunk_at - start - ttft) / (len(output_ids) - 1)
    prefill_meta = prefill.get("body", {}).get("meta_info") if isinstance(prefill.get("body"), dict) else None
    return PDGenerateResult(
        output_ids=output_ids,
        # HiCache hits are the prefill server's: its meta_info says where the prompt came from.
        meta_info=prefill_meta or last.get("meta_info", {}),
        ttft_s=ttft,
        e2e_s=e2e,
        error=error,
        tpot_s=tpot,
        prefill_meta_info=prefill_meta,
        decode_meta_info=last.get("meta_info"),
    )


def latency_summary(ttfts_s: Sequence[Optional[float]], tpots_s: Sequence[Optional[float]]) -> Dict[str, Any]:
    """Median and max TTFT and TPOT in milliseconds over the requests that have them."""
    out: Dict[str, Any] = {}
    for name, values in (("ttft", ttfts_s), ("tpot", tpots_s)):
        ms = [v * 1e3 for v in values if v is not None]
        out[f"{name}_requests"] = len(ms)
        out[f"{name}_median_ms"] = round(statistics.median(ms), 3) if ms else None
        out[f"{name}_max_ms"] = round(max(ms), 3) if ms else None
    return out
