"""Materialising a meta-built module: layout-free seeded initial values, and errors that say what to define."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid.strategies import block_seed, seeded_init
from lightning_hybrid.strategies._materialize import materialize_module

pytestmark = pytest.mark.unit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        self.scale = nn.Linear(2, 1)


def test_each_block_draws_from_its_own_seeded_stream():
    assert block_seed("layers.0", 1) == block_seed("layers.0", 1)
    assert len({block_seed("layers.0", 1), block_seed("layers.1", 1), block_seed("layers.0", 2)}) == 3
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    with seeded_init("layers.0", seed=1):
        a = torch.randn(3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global stream is untouched
    with seeded_init("layers.0", seed=1):
        assert torch.equal(torch.randn(3), a)


def test_meta_blocks_get_what_reset_parameters_gives_under_the_block_seed():
    with torch.device("meta"):
        net = Net()
    materialize_module(net, device=torch.device("cpu"), seed=3, then=None)
    eager = Net()
    for name, block in [*((f"layers.{n}", b) for n, b in eager.layers.named_children()), ("scale", eager.scale)]:
        with seeded_init(name, seed=3):
            for sub in block.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
    for (name, got), want in zip(net.state_dict().items(), eager.state_dict().values()):
        assert not got.is_meta and torch.equal(got, want), name


def test_a_submodule_without_an_initialiser_is_named():
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        net = nn.Module()
        net.layers = nn.Sequential(nn.Linear(2, 2), Raw())
    with pytest.raises(TypeError, match=r"layers\.1.*reset_parameters\(\).*init_block"):
        materialize_module(net, device=torch.device("cpu"), seed=0, then=None)
    # weights that init_from will overwrite need no initialiser
    materialize_module(net, device=torch.device("cpu"), seed=0, then=None, loaded=True)
    assert not net.layers[1].w.is_meta


def test_tensor_attributes_left_on_meta_are_named():
    with torch.device("meta"):
        net = Net()
        net.layers[0].cache = torch.zeros(2)  # a plain attribute, as metric states are
    with pytest.raises(TypeError, match=r"layers\.0\.cache.*configure_model"):
        materialize_module(net, device=torch.device("cpu"), seed=0, then=None)


def test_tied_meta_parameters_are_found_on_the_whole_module():
    from lightning_hybrid.strategies._materialize import tied_on_meta

    with torch.device("meta"):
        net = nn.Module()
        net.layers = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    assert tied_on_meta(net) == []
    net.layers[1].weight = net.layers[0].weight  # the usual tied embedding
    assert tied_on_meta(net) == [["layers.0.weight", "layers.1.weight"]]


def test_an_empty_message_is_still_an_agreed_failure():
    from lightning_hybrid._agree import agreed_problem

    assert agreed_problem(None) is None
    assert agreed_problem("") == "failed without a message"
    assert agreed_problem("bad key") == "bad key"
