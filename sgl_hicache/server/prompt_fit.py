"""Which prompts sglang 0.5.23's prefill admission can ever admit (hook 16 in hooks.py).

sglang clips a request's `max_new_tokens` to "the empty-pool budget" when the request arrives
(`Scheduler.init_req_max_new_tokens` → the allocator's `max_new_tokens_for_memory`, whose contract
is "None means prompt cannot fit": the request is then answered with an error at once). Its
admission (`PrefillAdder.add_one_req`) admits a prompt of L tokens only while

    (L - cached prefix) + max_new_tokens + page_size  <  free + evictable slots,

and the cached prefix is locked while it checks, so no pool state ever offers more than
`capacity - cached prefix`: a prompt with L + max_new_tokens + page_size >= capacity is never
admitted. The base allocator's clip returns 0 for such a prompt instead of None (when
page_size > 5: `--max-total-tokens` T, page 64, a prompt of T - 64 tokens). The request then waits at
the head of the queue forever, and sglang's admission loop, which stops at the first request that
does not fit, holds back every request queued behind it: the server never answers again
(seen with `--max-total-tokens 20544`, page 64, a prompt of 20,480 tokens; plain
`sglang.launch_server` does the same).
"""

from __future__ import annotations


def prefill_room(input_tokens: int, page_size: int, capacity: int) -> int:
    """The most new tokens a request with a prompt of `input_tokens` can ask and still be admitted
    by sglang 0.5.23's prefill admission on a pool of `capacity` slots in pages of `page_size`
    (the module's inequality); negative: the prompt itself can never be admitted."""
    return capacity - input_tokens - page_size - 1
