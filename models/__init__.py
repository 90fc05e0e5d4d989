"""Plain single-device models. Nothing here imports torch.distributed.

Each declares what the model contract (framework/contract.py) asks of it; the config names it
by ``_target_`` (conf/model/*.yaml), as a user's own model is named.
"""

from models.gpt import GPT
from models.llama import Llama
from models.lstm import LSTMClassifier
from models.mlp import MLP
from models.resnet import ResNet

__all__ = ["GPT", "Llama", "MLP", "LSTMClassifier", "ResNet"]
