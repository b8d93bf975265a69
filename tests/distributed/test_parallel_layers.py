"""The tensor-parallel layers over gloo (2 and 4 ranks) against the whole layer computed in float64 on the same
weights: column / row / merged / QKV linear layers, the vocabulary-parallel embedding and the gathered logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from vllm.distributed import parallel_state as ps
from vllm.utils import get_open_port

ATOL = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=ATOL, rtol=1e-5)


def _linear_cases(rank: int, tp: int, gen: torch.Generator) -> None:
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    x = torch.randn(5, 8, generator=gen)
    w, b = torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    ref = x.double() @ w.double().T + b.double()  # [5, 12]
    per = 12 // tp

    col = ColumnParallelLinear(8, 12, bias=True, gather_output=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert col.weight.shape == (per, 8) and col.weight.full_shape == (12, 8)
    _close(col(x), ref)
    col.gather_output = False
    _close(col(x), ref[:, rank * per:(rank + 1) * per])

    # Row-parallel: the whole input (input_is_parallel=False) or this rank's part of it; the bias counted once.
    w2, b2 = torch.randn(5, 12, generator=gen), torch.randn(5, generator=gen)
    ref2 = ref @ w2.double().T + b2.double()  # [5, 5]
    row = RowParallelLinear(12, 5, bias=True, input_is_parallel=False)
    row.weight.weight_loader(row.weight, w2)
    row.bias.weight_loader(row.bias, b2)
    assert row.weight.shape == (5, per)
    _close(row(ref.float()), ref2)
    row.input_is_parallel = True
    _close(row(col(x)), ref2)  # column (not gathered) -> row: the Megatron MLP pattern
    row.reduce_results = False
    partial = row(col(x))
    _close(ps.tensor_model_parallel_all_reduce(partial.clone()), ref2)

    # Merged gate/up, loaded projection by projection, then SiluAndMul and down_proj: the whole MLP.
    gate, up, down = (torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen),
                      torch.randn(8, 16, generator=gen))
    merged = MergedColumnParallelLinear(8, [16, 16])
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    down_proj = RowParallelLinear(16, 8)
    down_proj.weight.weight_loader(down_proj.weight, down)
    h = merged(x)
    local = 16 // tp
    hidden = F.silu(h[:, :local]) * h[:, local:]
    xd = x.double()
    ref_mlp = (F.silu(xd @ gate.double().T) * (xd @ up.double().T)) @ down.double().T
    _close(down_proj(hidden), ref_mlp)
    # The whole fused tensor (shard id None: [gate; up] as one rank holds it) gives the same shard.
    merged2 = MergedColumnParallelLinear(8, [16, 16])
    merged2.weight.weight_loader(merged2.weight, torch.cat([gate, up]))
    assert torch.equal(merged2.weight, merged.weight)
    with pytest.raises(ValueError, match="does not fit"):
        merged.weight.weight_loader(merged.weight, gate[:8], 0)

    # QKV: 4 query heads and 2 KV heads of size 2. Rank r holds query heads [r*4/tp, (r+1)*4/tp) and KV heads
    # [r*2/tp, ...) at tp=2, KV head r // 2 at tp=4 (replicated on 2 ranks).
    wq, wk, wv = (torch.randn(8, 8, generator=gen), torch.randn(4, 8, generator=gen),
                  torch.randn(4, 8, generator=gen))
    bq, bk, bv = torch.randn(8, generator=gen), torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    qkv = QKVParallelLinear(8, 2, 4, 2, bias=True)
    for shard_id, wt, bt in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        qkv.weight.weight_loader(qkv.weight, wt, shard_id)
        qkv.bias.weight_loader(qkv.bias, bt, shard_id)
    kv_heads = [rank] if tp == 2 else [rank // 2]
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == ((2, 1, 1) if tp == 2 else (1, 1, 2))
    q_rows = list(range(rank * 8 // tp, (rank + 1) * 8 // tp))
    kv_rows = [2 * hd + i for hd in kv_heads for i in range(2)]
    expected = torch.cat([xd @ wq.double()[q_rows].T + bq.double()[q_rows],
                          xd @ wk.double()[kv_rows].T + bk.double()[kv_rows],
                          xd @ wv.double()[kv_rows].T + bv.double()[kv_rows]], dim=-1)
    _close(qkv(x), expected)
    assert qkv.weight.stacked_full_sizes == {"q": 8, "k": 4, "v": 4}


def _vocab_cases(rank: int, tp: int, gen: torch.Generator) -> None:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    vocab, dim = 100, 6  # padded to 128: 64 rows a rank at tp=2 (rank 1: 36 real), 32 at tp=4 (rank 3: 4 real)
    table = torch.randn(vocab, dim, generator=gen)
    embed = VocabParallelEmbedding(vocab, dim)
    embed.weight.weight_loader(embed.weight, table)
    per = 128 // tp
    real = max(0, min(per, vocab - rank * per))
    assert embed.weight.shape == (per, dim) and embed.num_org_embeddings_per_partition == real
    assert torch.equal(embed.weight[:real], table[rank * per:rank * per + real])
    assert not embed.weight[real:].any()
    ids = torch.tensor([0, 1, per - 1, per, 63, 64, 99, 98, 31, 32, 50])
    _close(embed(ids), table.double()[ids])

    head = ParallelLMHead(vocab, dim)
    head.tie_weights(embed)
    assert head.weight is embed.weight
    hidden = torch.randn(4, dim, generator=gen)
    logits = LogitsProcessor(vocab)(head, hidden)
    assert logits.shape == (4, vocab) and logits.is_contiguous()
    _close(logits, hidden.double() @ table.double().T)


def _member(rank: int, tp: int, port: int) -> None:
    ps.init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.initialize_model_parallel(tp)
    try:
        # NOTE: the same seed on every rank: every rank builds the same whole tensors and keeps its part.
        gen = torch.Generator().manual_seed(0)
        _linear_cases(rank, tp, gen)
        _vocab_cases(rank, tp, gen)
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_the_whole_layer(tp: int) -> None:
    mp.spawn(_member, args=(tp, get_open_port()), nprocs=tp, join=True)


def test_one_rank_layers_are_unsplit_and_unpadded() -> None:
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert VocabParallelEmbedding(100, 6).weight.shape == (100, 6)
    assert pad_vocab_size(100) == 128 and pad_vocab_size(128) == 128 and pad_vocab_size(151936) == 151936
    assert QKVParallelLinear(8, 2, 4, 2).weight.shape == (16, 8)
    row = RowParallelLinear(4, 3, bias=True)
    row.weight.data.copy_(torch.eye(3, 4))
    row.bias.data.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert row(torch.tensor([[1.0, 1.0, 1.0, 1.0]])).tolist() == [[2.0, 3.0, 4.0]]


def test_model_config_heads_per_rank_and_split_checks() -> None:
    from vllm.config.model import ModelConfig
    mc = ModelConfig()  # the bundled tiny model: 4 query heads, 2 KV heads, intermediate 512, vocab 4096
    tp = [SimpleNamespace(tensor_parallel_size=n) for n in (1, 2, 4)]
    assert [mc.get_num_kv_heads(p) for p in tp] == [2, 1, 1]
    assert [mc.get_num_attention_heads(p) for p in tp] == [4, 2, 1]
    for p in tp:
        mc.verify_with_parallel_config(p)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        mc.verify_with_parallel_config(SimpleNamespace(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        mc.verify_with_parallel_config(SimpleNamespace(tensor_parallel_size=8))


def test_batch_sharded_sampling_refused_with_several_ranks() -> None:
    from vllm.config.parallel import ParallelConfig
    assert ParallelConfig(enable_batch_sharded_sampling=True).tensor_parallel_size == 1  # accepted, no effect
    assert ParallelConfig(tensor_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="enable_batch_sharded_sampling=True is not supported with "
                                         "tensor_parallel_size > 1"):
        ParallelConfig(tensor_parallel_size=2, enable_batch_sharded_sampling=True)
