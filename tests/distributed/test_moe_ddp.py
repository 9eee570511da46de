"""LoadBalance on 2 gloo ranks (DDP, and FSDP2): every mode equals one process on the whole window
(each mode's own reference loop; "global": the whole window's balancing loss), float64, after 3
windows with a clip that acts, momentum and a scheduler."""

import pytest
import torch

from tests.moe.models import CLIP
from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.moe_ranks", tmp_path_factory.mktemp("moe"), timeout=400.0)


@pytest.mark.parametrize("name", ["tiny_global", "tiny_rolling", "tiny_micro_batch", "qwen3_global",
                                  "tiny_fsdp_global"])
def test_every_mode_on_two_ranks_equals_one_process(ranks, name):
    results = scenario(ranks, name)
    print(f"{name} on 2 ranks: max parameter difference {max(r['diff'] for r in results):.1e}")
    for r in results:
        assert r["steps"] == 3
        assert min(r["ref_norms"]) > CLIP  # the clip acts
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=1e-12, atol=0)
        assert r["diff"] < 1e-12, r["diff"]
    # the load is the window's over both ranks: the same on each
    assert torch.equal(results[0]["load"], results[1]["load"])
