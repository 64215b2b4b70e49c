"""The fake server's planted server errors: ``FAKE_SGLANG_FAIL_EVERY=N`` fails exactly every Nth
``/generate`` even when handler threads run at once (the soak's error-count test depends on it).

Planted bug: the handler reading the shared request counter after ``generate`` released the lock
(as it did until CI counted 7 errors of 8) -> with a delay after ``generate`` every request of the
burst sees the final count and the test counts 20 errors, not 4 (reverted).
"""

import json
import os
import threading
import unittest
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e import fake_sglang_server as fake_server

register_cpu_ci(est_time=3, suite="stage-a-test-cpu")

REQUESTS = 20
FAIL_EVERY = 5


class SlowAfterCount(fake_server.FakeSglang):
    """Holds every handler after its request was counted, until the whole burst has been counted: the
    interleaving in which a handler that read the shared counter late would see another's count."""

    def __init__(self, args):
        super().__init__(args)
        self.all_counted = threading.Event()

    def generate(self, body):
        result = super().generate(body)
        if self.counters["requests"] >= REQUESTS:
            self.all_counted.set()
        self.all_counted.wait(timeout=10)
        return result


class TestPlantedServerErrors(CustomTestCase):
    def test_every_nth_request_fails_under_concurrency(self):
        fake = SlowAfterCount(fake_server.parse_serve_args(["--port", "0", "--max-total-tokens", "4096"]))
        server = ThreadingHTTPServer((fake_server.LOOPBACK, 0), fake_server.make_handler(fake))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://{fake_server.LOOPBACK}:{server.server_address[1]}/generate"

        def send(i):
            body = json.dumps({"input_ids": [i + 1] * 64, "sampling_params": {"max_new_tokens": 1}}).encode()
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status
            except urllib.error.HTTPError as e:
                return e.code

        try:
            with mock.patch.dict(os.environ, {fake_server.FAIL_EVERY_ENV: str(FAIL_EVERY)}):
                with ThreadPoolExecutor(REQUESTS) as pool:
                    statuses = list(pool.map(send, range(REQUESTS)))
        finally:
            server.shutdown()
            server.server_close()
        self.assertEqual(fake.counters["requests"], REQUESTS)
        self.assertEqual(statuses.count(500), REQUESTS // FAIL_EVERY, statuses)
        self.assertEqual(statuses.count(200), REQUESTS - REQUESTS // FAIL_EVERY, statuses)


if __name__ == "__main__":
    unittest.main()
