"""`bench latency --profile`'s kernel groups: kernel names (as the torch profiler reports them on an H200, incl.
names seen in the Flash-layer profiles) -> groups, and the per-step totals over synthetic kernel lists."""

from __future__ import annotations

import pytest

from sparkspec.bench.latency import GROUP_ORDER, format_groups, group_kernel_times, kernel_group

NAMES = [
    ("_fp8_linear_kernel", "fp8_linears"),
    ("_sum_splits_kernel", "fp8_linears"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1", "fp8_linears"),
    ("_mix_partial_kernel", "mhc"),
    ("_mhc_pre_finish_kernel", "mhc"),
    ("_hc_head_finish_kernel", "mhc"),
    ("_mhc_post_kernel", "mhc"),
    ("_sparse_attention_kernel", "attention"),
    ("_indexer_scores_kernel", "attention"),
    ("_emit_entries_kernel", "attention"),
    ("_emit_pool_kernel", "attention"),
    ("_store_states_kernel", "attention"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float>)",
     "moe_routing"),
    ("void at::native::radixSortKVInPlace<-2, -1, 16, 2, long, long, unsigned long>(at::cuda::detail::Tens",
     "moe_routing"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda(at::TensorIteratorBase&)",
     "moe_routing"),
    ("_topk_select_kernel", "attention"),  # the indexer's top-k, not the router's
    ("_moe_route_kernel", "moe_routing"),
    ("_moe_sort_kernel", "moe_routing"),
    ("_moe_up_kernel", "fp4_experts"),
    ("_sum_slots_kernel", "fp4_experts"),
    ("_swiglu_kernel", "shared_expert"),
    ("_moe_down_kernel", "fp4_experts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)",
     "shared_expert"),
    ("_norm_rope_kernel", "norms_rope"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsig",
     "sampling"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4>", "sampling"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>", "dense_gemm"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "dense_gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute",
     "dense_gemm"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_tn_align1>", "dense_gemm"),
    ("void at::native::radixSortKVInPlace<-2, -1, 32, 32, float, long, unsigned int>(at::cuda::detail::Tens", "other"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<2, at::native::FillFunctor<float>, std::array<char*, 1ul> >",
     "other"),
]


@pytest.mark.parametrize("name,group", NAMES, ids=[f"{g}:{n[:30]}" for n, g in NAMES])
def test_kernel_names_map_to_their_group(name, group):
    assert kernel_group(name) == group


def test_every_group_of_the_table_is_reachable_and_ordered():
    assert GROUP_ORDER[-1] == "other"
    assert set(GROUP_ORDER) == {g for _, g in NAMES}


def test_group_times_are_per_step_and_add_up():
    kernels = [("_fp8_linear_kernel", 10.0)] * 6 + [("_moe_up_kernel", 400.0)] * 2 + [("FillFunctor", 1.0)] * 4
    prof = group_kernel_times(kernels, num_steps=2)
    g = prof["groups"]
    assert list(g) == list(GROUP_ORDER)  # every group, empty ones too, in order
    assert g["fp8_linears"] == {"ms": 0.03, "kernels": 3, "share": round(60 / 864, 3)}
    assert g["fp4_experts"]["ms"] == 0.4 and g["fp4_experts"]["kernels"] == 1
    assert g["other"]["kernels"] == 2 and g["mhc"] == {"ms": 0.0, "kernels": 0, "share": 0.0}
    assert abs(sum(v["share"] for v in g.values()) - 1) < 1e-2
    assert prof["top_other"] == [("FillFunctor", 0.002)]
    table = format_groups(prof)
    assert "| fp4_experts | 0.4000 | 1 |" in table and "| total | 0.4320 | 6 |" in table


def test_no_kernels_gives_zero_groups():
    prof = group_kernel_times([], num_steps=8)
    assert all(v["ms"] == 0 and v["kernels"] == 0 for v in prof["groups"].values())
