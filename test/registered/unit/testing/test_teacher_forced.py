"""Teacher-forced scoring (``sglang_cp_shared_kv_testing/e2e/teacher_forced``): texts, the client against sglang's
``/generate`` answer shape, and the verdict against the stock server's pass-to-pass spread.

Seen failing: with the continuation's logprobs taken from the front of ``input_token_logprobs``
(the prefix's last token, which sglang scores first, shifted every value by one token), and with
the verdict's stock noise taken between the stock and the shared-KV pass (a broken server then
widened its own tolerance).
"""

import json
import threading
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e import teacher_forced
from sglang_cp_shared_kv_testing.e2e.request_plan import build_plan

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


def _plan():
    return build_plan([16384, 32768], hicache_ratio=2.0, page_size=64, max_prefix_tokens=8192,
                      max_new_tokens=4, token_id_range=(0, 256), seed=0)  # fmt: skip


class _Sglang(BaseHTTPRequestHandler):
    """``/generate`` as sglang answers it: the logprob of each input token from
    ``logprob_start_len`` on, as [logprob, token id, text]; the first entry None when it starts the
    prompt. The logprob of token i is -(i % 7) / 10 - token_id / 1000 here."""

    bodies = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Sglang.bodies.append(body)
        ids, start = body["input_ids"], body["logprob_start_len"]
        entries = [[None if i == 0 else -(i % 7) / 10 - ids[i] / 1000, ids[i], None] for i in range(start, len(ids))]
        data = json.dumps({"meta_info": {"input_token_logprobs": entries, "cached_tokens": start // 64 * 64}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class TestTeacherForced(CustomTestCase):
    def test_texts_are_served_prefixes_with_a_fixed_continuation(self):
        plan = _plan()
        texts = teacher_forced.scoring_texts(plan, 3)
        again = teacher_forced.scoring_texts(plan, 3)
        self.assertEqual(len({t.rid for t in texts}), 3)
        self.assertEqual([t.input_ids for t in texts], [t.input_ids for t in again])
        for text in texts:
            request = next(r for r in plan.requests if f"score-p{r.prefix_id}" == text.rid)
            self.assertEqual(text.input_ids[: text.prefix_tokens], plan.input_ids(request)[: request.prefix_tokens])
            self.assertEqual(len(text.input_ids) - text.prefix_tokens, teacher_forced.CONTINUATION_TOKENS)

    def test_client_scores_the_continuation_only(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sglang)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            text = teacher_forced.ScoredText("t", 128, list(range(128 + 8)))
            result = teacher_forced.score(f"http://127.0.0.1:{server.server_port}", text, 10)
        finally:
            server.shutdown()
        self.assertEqual(_Sglang.bodies[-1]["logprob_start_len"], 127)  # the cached prefix ends a token early
        want = [-(i % 7) / 10 - i / 1000 for i in range(128, 136)]
        self.assertEqual(result["logprobs"], want)

    def test_verdict_against_the_stock_pass_to_pass_spread(self):
        stock = {"passes": [[[-1.0, -2.0, -3.0]], [[-1.1, -2.0, -2.9]]]}  # noise 0.067 nats on average
        close = {"passes": [[[-1.05, -2.1, -3.0]], [[-1.0, -2.0, -3.0]]]}
        far = {"passes": [[[-0.2, -4.0, -1.0]], [[-0.2, -4.0, -1.0]]]}
        self.assertEqual(teacher_forced.verdict(stock, close)["failures"], [])
        found = teacher_forced.verdict(stock, far)["failures"]
        self.assertTrue(any("mean" in f for f in found), found)
        errors = teacher_forced.verdict(stock, {"passes": [[None]], "errors": ["t pass 0: HTTP 500"]})["failures"]
        self.assertIn("teacher-forced: t pass 0: HTTP 500", errors)
        self.assertIn("teacher-forced: no continuation token scored on both servers", errors)


if __name__ == "__main__":
    unittest.main()
