"""Output-length predictors (TetriInfer §3.3.2): bucket classifiers, baselines, an oracle for
simulations, training and the accuracy report. Torch-free."""

from __future__ import annotations

from pdserve.config import LENGTH_PREDICTORS, check_granularity
from pdserve.predict.base import (
    PREDICTORS,
    LengthPrediction,
    LengthPredictor,
    bucket_of,
)
from pdserve.predict.classifier import SoftmaxClassifier
from pdserve.predict.data import fit_predictor, load_pairs
from pdserve.predict.predictors import Majority, Oracle, PromptLength

PREDICTOR_NAMES = LENGTH_PREDICTORS  # "none" and every registered predictor


def make_predictor(name: str, granularity: int = 200, accuracy: float = 1.0,
                   data: str | None = None, seed: int = 0) -> LengthPredictor | None:
    """The deployment's predictor (``ClusterConfig.predictor.name``): ``none``; ``oracle``
    at ``accuracy``; ``classifier`` loaded from a saved ``.npz``; or any trainable predictor
    fitted now on ``data`` (logged pairs or a trace name)."""
    check_granularity(granularity)
    if name == "none":
        return None
    if name not in PREDICTORS:
        raise ValueError(f"unknown length predictor {name!r}; available: "
                         f"{list(PREDICTOR_NAMES)}")
    if name == "oracle":
        return Oracle(granularity, accuracy, seed)
    if data is None:
        raise ValueError(f"length predictor {name!r} needs training data or a saved model "
                         f"(predictor_data)")
    if data.endswith(".npz"):
        if name != "classifier":
            raise ValueError("a saved .npz model is a 'classifier'")
        return SoftmaxClassifier.load(data)
    return fit_predictor(name, granularity, load_pairs(data), seed=seed)


__all__ = ["PREDICTORS", "PREDICTOR_NAMES", "LengthPrediction", "LengthPredictor", "Majority",
           "Oracle", "PromptLength", "SoftmaxClassifier", "bucket_of", "check_granularity",
           "make_predictor"]
