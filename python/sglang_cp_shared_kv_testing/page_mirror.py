"""Host page mirrors for test batches whose ``req_to_token`` a test writes directly.

The runtime plans from its pool state's ``ReqToPageMirror`` (fed by sglang's writers on a server).
A test that fills a small table by hand calls ``mirrored(forward_batch)``: the mirror is copied from
the table (a test may read it), the state of the batch's KV pool (if any) plans from it, and the
batch gets its host rows, as ``ForwardBatch.init_new`` keeps them.
"""

from __future__ import annotations

from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror, mirror_of
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import state_of


def mirrored(forward_batch, page_size: int = 64):
    pool = forward_batch.req_to_token_pool
    mirror = mirror_of(pool) or ReqToPageMirror.attach(pool, page_size)
    table = pool.req_to_token.cpu().long()
    mirror.pages[:] = (table[:, ::page_size] // page_size).numpy()
    state = state_of(getattr(forward_batch, "token_to_kv_pool", None))
    if state is not None:
        state.mirror = mirror
    setattr(forward_batch, ROWS_ATTR, forward_batch.req_pool_indices.cpu().numpy())
    return forward_batch
