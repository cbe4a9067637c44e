"""What is predicted: memory, step time, power and thermals of a layout (pure functions), and
surrogates fitted to measurements."""
from advisor.models.constants import DEFAULT, Constants
from advisor.models.predict import Prediction, predict

__all__ = ["Constants", "DEFAULT", "Prediction", "predict"]
