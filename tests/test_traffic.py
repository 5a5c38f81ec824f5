"""What the ring sends (xcp.traffic), counted against the tensors themselves."""

from __future__ import annotations

import torch

from xcp.traffic import ring_bytes, ring_traffic


def test_ring_traffic_counts_the_bytes_of_the_shards_sent():
    k = torch.empty(1, 64 // 8, 2, 16, dtype=torch.bfloat16)  # one rank's K (V alike): batch 1 by default
    acc = torch.empty(1, 64 // 8, 2, 16, dtype=torch.float32)  # dK/dV accumulate in float32
    t = ring_traffic(64, 8, 5, 2, 16, torch.bfloat16)
    assert (t.world, t.steps) == (8, 5)
    assert t.kv_shard == 2 * k.numel() * k.element_size()
    assert t.dkv_message == 2 * acc.numel() * acc.element_size()
    assert ring_bytes(64, 8, 5, 2, 16, 16, torch.bfloat16) == t
    assert ring_traffic(64, 8, 5, 2, 16, torch.bfloat16, batch=3).kv_shard == 3 * t.kv_shard
