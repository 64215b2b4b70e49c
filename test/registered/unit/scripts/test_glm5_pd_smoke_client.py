"""The PD smoke's router-less client: one request goes to both servers with the same bootstrap room
and the prefill's bootstrap address; tokens and timings come from the decode stream, HiCache hits
from the prefill's meta_info; a failure on either side is reported. Against two local fake servers."""

import json
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e.pd_generate import generate_greedy_pd, latency_summary

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

TOKENS = [11, 12, 13, 14]


def fake_server(role, received, prefill_status=200):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked streaming, as uvicorn serves sglang's stream

        def log_message(self, *args):
            pass

        def write_chunk(self, data: bytes):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received[role] = body
            if role == "prefill":
                payload = json.dumps({"meta_info": {"cached_tokens": 64, "cached_tokens_details": {"host": 64}}})
                self.send_response(prefill_status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n in range(1, len(TOKENS) + 1):
                time.sleep(0.02)
                chunk = {"output_ids": TOKENS[:n], "meta_info": {"cached_tokens": 0}}
                self.write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            self.write_chunk(b"data: [DONE]\n\n")
            self.write_chunk(b"")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class TestPDClient(CustomTestCase):
    def run_pair(self, prefill_status=200):
        received = {}
        prefill = fake_server("prefill", received, prefill_status)
        decode = fake_server("decode", received)
        try:
            result = generate_greedy_pd(
                f"http://127.0.0.1:{prefill.server_port}",
                f"http://127.0.0.1:{decode.server_port}",
                bootstrap_port=8998,
                input_ids=[1, 2, 3],
                max_new_tokens=len(TOKENS),
                timeout_s=30,
            )
        finally:
            prefill.shutdown()
            decode.shutdown()
        return result, received

    def test_same_room_to_both_and_timings_from_decode(self):
        result, received = self.run_pair()
        self.assertIsNone(result.error)
        p, d = received["prefill"], received["decode"]
        self.assertEqual(p["bootstrap_room"], d["bootstrap_room"])
        self.assertEqual((p["bootstrap_host"], p["bootstrap_port"]), ("127.0.0.1", 8998))
        self.assertEqual((d["bootstrap_host"], d["bootstrap_port"]), ("127.0.0.1", 8998))
        self.assertTrue(d["stream"])
        self.assertEqual(p["sampling_params"]["temperature"], 0.0)
        self.assertEqual(result.output_ids, TOKENS)
        self.assertEqual(result.meta_info["cached_tokens_details"]["host"], 64)  # the prefill's view
        self.assertGreater(result.ttft_s, 0)
        self.assertGreater(result.tpot_s, 0.005)  # chunks 20 ms apart
        summary = latency_summary([result.ttft_s, None], [result.tpot_s])
        self.assertEqual((summary["ttft_requests"], summary["tpot_requests"]), (1, 1))

    def test_prefill_failure_is_reported(self):
        result, _ = self.run_pair(prefill_status=500)
        self.assertIn("prefill HTTP 500", result.error)


if __name__ == "__main__":
    unittest.main()
