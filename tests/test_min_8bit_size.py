"""Which params keep 8-bit moments: ``min_8bit_size`` (docs/spec.md section 9).

References, independent of the code under test:
* bitsandbytes' rule as its Optimizer2State states it (``p.numel() < min_8bit_size``: float32
  state), written out here as a table of shapes;
* torchao's own choice for the same shapes (``AdamW8bit._new_buffer`` / ``AdamWFp8._new_buffer``
  return a quantized subclass or a plain float32 tensor), when torchao imports;
* the fp32-state wrapper on the same grads: a param under the threshold must step bit for bit
  as with float32 state; the format functions (tpamp.state_formats encode/decode, themselves
  checked against numpy and torchao in test_state_formats.py / test_dynamic_map.py) for the
  values a conversion must give.
"""

from __future__ import annotations

import io

import pytest
import torch
from dist_utils import fused_step_built, run_workers

import tpamp
from tpamp import state_formats as sf

U8, F8, F32 = torch.uint8, torch.float8_e4m3fn, torch.float32

needs_kernel = pytest.mark.skipif(not fused_step_built(),
                                  reason="tpamp._C with the fused step kernels is not built")

# (shape, kept 8-bit under the default 4096) as bitsandbytes states its rule: numel >= 4096
TABLE = [
    ((7,), False), ((256,), False), ((4095,), False), ((63, 65), False),  # 4095 elements
    ((4096,), True), ((64, 64), True), ((4097,), True), ((40, 300), True), ((1, 4352), True),
    ((300, 7), False), ((0,), False),
]


@pytest.mark.parametrize("shape,eight_bit", TABLE)
@pytest.mark.parametrize("dtype", [U8, F8])
def test_rule_matches_the_stated_table(shape, eight_bit, dtype):
    numel = torch.Size(shape).numel()
    m, v = sf.param_moment_dtypes(numel, dtype, dtype, sf.MIN_8BIT_SIZE)
    assert (m, v) == ((dtype, dtype) if eight_bit else (F32, F32))
    # bf16 / fp32 moments are never changed; 0 keeps every param 8-bit (the old layout)
    assert sf.param_moment_dtypes(numel, torch.bfloat16, F32, 4096) == (torch.bfloat16, F32)
    assert sf.param_moment_dtypes(numel, dtype, torch.bfloat16, 0) == (dtype, torch.bfloat16)
    assert sf.param_moment_dtypes(numel, dtype, torch.bfloat16, 4096) == (
        dtype if eight_bit else F32, torch.bfloat16)


@pytest.mark.parametrize("cls_name,dtype", [("AdamW8bit", U8), ("AdamWFp8", F8)])
def test_rule_matches_torchaos_buffer_choice(cls_name, dtype):
    """torchao quantizes a tensor when numel >= 4096 and numel % 256 == 0 (it cannot pad a
    last block; tpamp pads, so it follows bitsandbytes on the other shapes: compared here on
    the shapes where the two libraries agree, and the difference stated)."""
    optim = pytest.importorskip("torchao.optim")
    cls = getattr(optim, cls_name)
    for n in (1, 255, 256, 1024, 3840, 4095, 4096, 4352, 8192, 120832, 65536 + 256):
        p = torch.nn.Parameter(torch.zeros(n))
        theirs = type(cls([p])._new_buffer(p, True)) is not torch.Tensor
        ours = sf.param_moment_dtypes(n, dtype, dtype, sf.MIN_8BIT_SIZE)[0] == dtype
        assert ours == theirs, n
    for n in (4097, 5000, 12000):  # >= 4096 but not whole blocks: torchao float32, tpamp 8-bit
        p = torch.nn.Parameter(torch.zeros(n))
        assert type(cls([p])._new_buffer(p, True)) is torch.Tensor
        assert sf.param_moment_dtypes(n, dtype, dtype, sf.MIN_8BIT_SIZE)[0] == dtype


def _bare_adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))])


def test_bad_values_are_refused_before_anything_changes():
    for bad, exc, words in [("4096", TypeError, "int or None"), (True, TypeError, "bool"),
                            (4096.0, TypeError, "float"), (-1, ValueError, ">= 0")]:
        inner = _bare_adamw()
        param = inner.param_groups[0]["params"][0]
        with pytest.raises(exc, match=words):
            tpamp.MixedPrecisionOptimizer(inner, exp_avg_dtype=U8, exp_avg_sq_dtype=U8,
                                          min_8bit_size=bad)
        assert inner.param_groups[0]["params"][0] is param  # nothing wrapped
    for m, v in [(F32, F32), (torch.bfloat16, torch.bfloat16)]:
        inner = _bare_adamw()
        with pytest.raises(ValueError, match="not 8-bit.*leave it None"):
            tpamp.MixedPrecisionOptimizer(inner, exp_avg_dtype=m, exp_avg_sq_dtype=v,
                                          min_8bit_size=4096)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)).to(
        torch.bfloat16)  # 12000 (8-bit), 300, 2100, 7 (float32 under the default)


def _wrap(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return tpamp.MixedPrecisionOptimizer(inner, **kw)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        assert opt.step().update_successful


def _built(cfg, seed, steps=0, grad_seed=None):
    """_model(seed) wrapped with the configuration ``cfg``, trained ``steps`` steps on the grads
    of ``grad_seed``."""
    model = _model(seed)
    opt = _wrap(model, **CONFIGS[cfg])
    if steps:
        _train(model, opt, steps, grad_seed)
    return model, opt


def _state(opt, i):
    """The inner optimizer's state of the i-th main param."""
    return opt.optimizer.state[opt.optimizer.param_groups[0]["params"][i]]


CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "u8": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8),  # the default rule
    "u8+rem": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True),
    "u8-all": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, min_8bit_size=0),  # the old layout
    "e4m3": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8),
    "e4m3-all": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8, min_8bit_size=0),
    "u8-2000": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, min_8bit_size=2000),
}


def _want(cfg, numel):
    """The dtypes the configuration should store for a param of ``numel`` elements (the rule
    restated: bitsandbytes' numel < min_8bit_size -> float32)."""
    opts = CONFIGS[cfg]
    m, v = opts.get("exp_avg_dtype", F32), opts.get("exp_avg_sq_dtype", F32)
    limit = opts.get("min_8bit_size", 4096)
    small = numel < limit
    return tuple(F32 if small and d in (U8, F8) else d for d in (m, v))


def _stored(opt, model):
    out = []
    for i, p in enumerate(model.parameters()):
        st = _state(opt, i)
        out.append((p.numel(), st["exp_avg"].dtype, st["exp_avg_sq"].dtype,
                    sf.decode_moment(st["exp_avg"], st.get("exp_avg_scale")),
                    sf.decode_moment(st["exp_avg_sq"], st.get("exp_avg_sq_scale"), sqrt=True),
                    "exp_avg_scale" in st, "exp_avg_sq_scale" in st))
    return out


@needs_kernel
@pytest.mark.parametrize("cfg", ["u8", "u8+rem", "e4m3", "u8-2000", "u8-all"])
def test_small_params_keep_float32_moments_and_step_as_fp32_state(cfg):
    ma, a = _built(cfg, 0, 4, 3)
    mf, f = _built("fp32", 0, 4, 3)
    assert a.min_8bit_size == CONFIGS[cfg].get("min_8bit_size", 4096)
    sd = a.state_dict()["optimizer"]["state"]
    for i, ((n, m_dt, v_dt, *_rest, has_m, has_v), pa, pf) in enumerate(
            zip(_stored(a, ma), ma.parameters(), mf.parameters())):
        assert (m_dt, v_dt) == _want(cfg, n)
        assert has_m == (m_dt != F32) and has_v == (v_dt != F32)  # scales only for 8-bit
        assert sd[i]["exp_avg"].dtype == m_dt  # visible in the state dict
        if m_dt == F32:  # a float32 param: the fp32-state step, bit for bit
            assert torch.equal(pa, pf)
            fs, st = _state(f, i), _state(a, i)
            assert torch.equal(st["exp_avg"], fs["exp_avg"])
            assert torch.equal(st["exp_avg_sq"], fs["exp_avg_sq"])
    # bytes: 8-bit codes + scales for the big params, 8 bytes of moments for the others
    expect = 0
    for n, m_dt, v_dt, *_ in _stored(a, ma):
        master = 2 if CONFIGS[cfg].get("store_param_remainders") else 4
        moments = sum(n + 4 * sf.moment_blocks(n) if d in (U8, F8) else 4 * n
                      for d in (m_dt, v_dt))
        expect += master * n + moments + 4
    assert a.optimizer_state_bytes() == expect


PAIRS = [("u8-all", "u8"), ("u8", "u8-all"), ("u8", "fp32"), ("fp32", "u8"), ("u8", "bf16"),
         ("e4m3-all", "u8"), ("u8", "e4m3-all"), ("u8-2000", "u8"), ("e4m3", "u8+rem"),
         ("u8+rem", "u8-all")]


def _check_converted(src_state, dst_state, dst):
    for (n, sm, sv, m1, v1, _, _), (n2, m_dt, v_dt, m2, v2, _, _) in zip(src_state, dst_state):
        assert n == n2 and (m_dt, v_dt) == _want(dst, n)
        for x, y, src_dt, dt, sq in ((m1, m2, sm, m_dt, False), (v1, v2, sv, v_dt, True)):
            if dt == F32 or dt == src_dt:  # decoded exactly, or the same codes and scales
                assert torch.equal(x, y)
            else:  # the target's own encode of the source's values
                c, s = sf.encode_moment(x, dt, sqrt=sq)
                assert torch.equal(y, sf.decode_moment(c, s, sqrt=sq)), (n, dt)


@needs_kernel
@pytest.mark.parametrize("src,dst", PAIRS)
def test_state_dict_converts_between_layouts(src, dst):
    ms, a = _built(src, 1, 3, 7)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    md, b = _built(dst, 2)
    b.load_state_dict(torch.load(buf, weights_only=False))
    _check_converted(_stored(a, ms), _stored(b, md), dst)
    _train(md, b, 2, 8)  # and it trains on, keeping its layout
    assert [(m, v) for _, m, v, *_ in _stored(b, md)] == [_want(dst, p.numel())
                                                        for p in md.parameters()]


@needs_kernel
@pytest.mark.parametrize("src,dst", [("u8-all", "u8"), ("u8", "u8-all"), ("u8", "fp32"),
                                     ("e4m3", "u8"), ("u8+rem", "e4m3-all")])
def test_dcp_checkpoint_converts_between_layouts(tmp_path, src, dst):
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    ms, a = _built(src, 4, 3, 12)
    save_checkpoint(str(tmp_path), dict(ms.named_parameters()), a)
    md, b = _built(dst, 5)
    load_checkpoint(str(tmp_path), dict(md.named_parameters()), b)
    for x, y in zip(a.state_dict()["fp32_from_fp16_params"][0],
                    b.state_dict()["fp32_from_fp16_params"][0]):
        assert torch.equal(x, y)
    for (n, _, _, m1, v1, _, _), (_, m_dt, v_dt, m2, v2, _, _) in zip(_stored(a, ms),
                                                                      _stored(b, md)):
        assert (m_dt, v_dt) == _want(dst, n)
        if m_dt == F32:
            assert torch.equal(m1, m2) and torch.equal(v1, v2)
        else:  # one re-quantization of the saved float32 values (layout_free_state's note)
            c, s = sf.encode_moment(m1, m_dt)
            torch.testing.assert_close(m2, sf.decode_moment(c, s), rtol=1e-6, atol=0)
    _train(md, b, 2, 13)


# -- ZeRO-1 and FSDP2: the whole param decides, every DP rank alike -------------------------

def _zero1_built(dp, seed, limit):
    """A bf16 model of 6000 (3000 per rank at DP 2: under 4096 per shard, 8-bit as a whole),
    150, 1050 and 7 elements under the ZeRO-1 optimizer with uint8 moments; ``limit`` None:
    min_8bit_size left at its default."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(40, 150), torch.nn.Linear(150, 7)).to(torch.bfloat16)
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    kw = {} if limit is None else dict(min_8bit_size=limit)
    return m, tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=4000,
                                         param_names=m.named_parameters(), exp_avg_dtype=U8,
                                         exp_avg_sq_dtype=U8, **kw)


def _zero1_train(m, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in m.parameters():
            p.main_grad.copy_((torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16))
        assert opt.step().update_successful


def _zero1_worker(rank, world_size, limit):
    import torch.distributed as dist

    m, opt = _zero1_built(dist.new_group(list(range(world_size))), 0, limit)
    _zero1_train(m, opt, 2, 1)
    names = {id(p): n for n, p in m.named_parameters()}
    whole = {id(p): p.numel() for p in m.parameters()}
    rows = []
    for main in opt.optimizer.param_groups[0]["params"]:
        st = opt.optimizer.state[main]
        rows.append((main.numel(), str(st["exp_avg"].dtype), str(st["exp_avg_sq"].dtype),
                     str(opt.moment_dtypes(main)[0])))
    return rows, sorted((names[k], whole[k]) for k in whole)


def _mismatch_worker(rank, world_size):
    import torch.distributed as dist

    dp = dist.new_group(list(range(world_size)))
    m = torch.nn.Linear(40, 150).to(torch.bfloat16)
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
    try:
        tpamp.DistributedOptimizer(inner, data_parallel_group=dp, exp_avg_dtype=U8,
                                   exp_avg_sq_dtype=U8, min_8bit_size=4096 if rank else 0)
    except ValueError as e:
        return str(e)
    return ""


@needs_kernel
@pytest.mark.parametrize("limit", [None, 0, 100000])
def test_zero1_shards_decide_on_the_whole_param(limit):
    out = run_workers(_zero1_worker, 2, limit, timeout=60.0)
    lim = 4096 if limit is None else limit
    for rows, params in out:
        assert rows  # every rank holds pieces
        for numel, m, v, decided in rows:
            assert m == v == decided
    # the rule on the whole params (6000, 150, 1050, 7), not on a rank's pieces: a piece of
    # the 6000-element weight (3000 elements or fewer) is 8-bit on every rank under 4096
    sizes = [n for _, n in out[0][1]]
    assert sorted(sizes) == [7, 150, 1050, 6000]
    pieces = [r for rows, _ in out for r in rows]
    assert all(numel < 4096 for numel, *_ in pieces)  # no piece alone reaches 4096
    total = {}
    for numel, m, _, _ in pieces:
        total[m] = total.get(m, 0) + numel
    if lim == 4096:  # the 6000-element weight's pieces 8-bit on both ranks, the rest float32
        assert total == {"torch.uint8": 6000, "torch.float32": 150 + 1050 + 7}
    elif lim == 0:
        assert total == {"torch.uint8": 7207}
    else:
        assert total == {"torch.float32": 7207}


def test_ranks_with_different_min_8bit_size_are_refused():
    errors = run_workers(_mismatch_worker, 2, timeout=60.0)
    for e in errors:
        assert "min_8bit_size" in e, e


def _fsdp_worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from tpamp.parallel import initialize_model_parallel

    st = initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 150), torch.nn.Linear(150, 7))
    fully_shard(model, mesh=st.mesh["dp"])
    opt = tpamp.fsdp.fully_shard_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), st.mesh["dp"], exp_avg_dtype=U8,
        exp_avg_sq_dtype=U8)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 40, generator=gen)
    model(x).pow(2).mean().backward()
    assert opt.step().update_successful
    rows = []
    for p in opt.optimizer.param_groups[0]["params"]:
        s = opt.optimizer.state[p]
        local = s["exp_avg"].to_local() if hasattr(s["exp_avg"], "to_local") else s["exp_avg"]
        rows.append((p.numel(), local.numel(), str(local.dtype), "exp_avg_scale" in s))
    return rows


@needs_kernel
def test_fsdp2_decides_on_the_global_param():
    out = run_workers(_fsdp_worker, 2, timeout=90.0)
    # every rank stores each param (global numel) in the same dtype, whatever its shard's size
    assert [(r[0], r[2]) for r in out[0]] == [(r[0], r[2]) for r in out[1]]
    for rows in out:
        for numel, local, dtype, scaled in rows:
            want = "torch.uint8" if numel >= 4096 else "torch.float32"
            assert dtype == want and scaled == (want == "torch.uint8"), (numel, local, dtype)
        assert any(n >= 4096 and loc < 4096 for n, loc, _, _ in rows)  # a shard under 4096


def _zero1_dcp_worker(rank, world_size, path, src, dst):
    import torch.distributed as dist

    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    dp = dist.new_group(list(range(world_size)))
    ma, a = _zero1_built(dp, 0, src)
    _zero1_train(ma, a, 3, 3)
    save_checkpoint(path, dict(ma.named_parameters()), a)
    mb, b = _zero1_built(dp, 1, dst)
    load_checkpoint(path, dict(mb.named_parameters()), b)
    rows = []
    sa, sb = a.optimizer.state, b.optimizer.state
    for pa, pb in zip(a.optimizer.param_groups[0]["params"], b.optimizer.param_groups[0]["params"]):
        x = sf.decode_moment(sa[pa]["exp_avg"], sa[pa].get("exp_avg_scale"))
        y = sf.decode_moment(sb[pb]["exp_avg"], sb[pb].get("exp_avg_scale"))
        same = bool(torch.equal(x, y))
        close = bool(torch.allclose(x, y, rtol=0.07, atol=float(x.abs().max()) * 2 ** -8))
        rows.append((pb.numel(), str(sb[pb]["exp_avg"].dtype), str(b.moment_dtypes(pb)[0]),
                     same, close))
    return rows


@needs_kernel
@pytest.mark.parametrize("src,dst", [(0, 4096), (4096, 0)])
def test_zero1_dcp_converts_between_layouts(tmp_path, src, dst):
    out = run_workers(_zero1_dcp_worker, 2, str(tmp_path), src, dst, timeout=90.0)
    total = {}
    for rows in out:
        for numel, dtype, decided, same, close in rows:
            assert dtype == decided and close
            if dtype == "torch.float32":
                assert same  # the saved values exactly
            total[dtype] = total.get(dtype, 0) + numel
    want = {"torch.uint8": 6000, "torch.float32": 1207} if dst else {"torch.uint8": 7207}
    assert total == want
