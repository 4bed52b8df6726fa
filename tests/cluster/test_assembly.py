"""What ``cluster.assembly`` derives from a config and its model for the routers."""

from __future__ import annotations

from pathlib import Path

from cluster.assembly import selection_share
from cluster.config import ClusterConfig

DOCQA = Path(__file__).resolve().parents[2] / "modeltools" / "docqa_model"


def _config(**engine) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"name": "t", "model": {"name": "docqa", "path": str(DOCQA)}, "engine": engine}
    )


def test_the_selection_share_is_the_workers_deviation_layer_over_the_models_layers():
    """The doc-QA model has 8 layers: repair selects at layer 3 by default, so a placed
    token left as placed still costs 3/8 of a computed one in the router's estimate."""
    assert selection_share(_config(), DOCQA) == 3 / 8
    assert selection_share(_config(deviation_layer=5), DOCQA) == 5 / 8
