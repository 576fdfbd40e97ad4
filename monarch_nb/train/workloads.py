"""Training workloads: a model, a dataset and a loss, built identically in every worker.

- ``digits``: an MLP classifier on scikit-learn's bundled handwritten digits (1797 8x8 images,
  no download), 80/20 train/test split fixed by the seed.
- ``charlm``: a small causal transformer over the bytes of a real text file (by default the
  source of the standard library's :mod:`inspect` module, present on every Python install).
- ``llama``: a Llama-architecture causal LM (transformers' ``LlamaForCausalLM``, random init, a
  byte vocabulary: no tokenizer, no download) on the same text as ``charlm``; sizes in
  :data:`LLAMA_SIZES`. Needs the optional extra ``monarch_nb[llm]`` (transformers).
- :meth:`Workload.custom`: any model factory, dataset and loss.

A :class:`Workload` is built on the controller (cheap: it validates its inputs and knows its
training-set size) and pickled to the workers, which call :meth:`Workload.setup` to load data.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

__all__ = ["Workload", "get_workload", "WORKLOADS", "LLAMA_SIZES", "LlamaWorkload", "default_text_path"]

WORKLOADS = ("digits", "charlm", "llama")

#: ``LlamaConfig`` fields per size of the ``llama`` workload (vocabulary 256 bytes, context 64):
#: ``tiny`` has 106,816 parameters (tests, workshops), ``small`` 3,033,344 (benchmarks)
LLAMA_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}


def default_text_path() -> str:
    """A real text that exists offline on any machine: the source of the stdlib's ``inspect``."""
    import inspect

    return inspect.__file__


class Workload:
    """What to train. Subclasses set ``name``, ``num_train`` and implement the hooks.

    Attributes:
        name: short name ("digits", "charlm", "custom").
        num_train: number of training samples (int), known on the controller.
        default_lr: learning rate used when the caller gives none.
        default_batch: default global batch size (samples per step over all ranks).
        classification: True if ``accuracy`` is meaningful (argmax of the model's output).
        preload: modules its hooks import beyond torch, imported once by each host's fork server
            before any proc of the run (a rank or a warm spare) is forked from it, so a spare that
            takes a rank builds the model at once (third-party libraries only: never a module the
            user may edit while the run's procs live).
    """

    name = "workload"
    num_train = 0
    default_lr = 1e-3
    default_batch = 64
    classification = False
    preload: tuple[str, ...] = ()

    def setup(self) -> None:
        """Load data in the worker (called once per trainer, before any other hook)."""

    def build_model(self):
        """A fresh ``torch.nn.Module``; the caller seeds torch first so replicas start equal."""
        raise NotImplementedError

    def build_optimizer(self, params, lr: float):
        return __import__("torch").optim.Adam(params, lr=lr)

    def train_batch(self, indices: Sequence[int]) -> tuple[Any, Any]:
        """``(inputs, targets)`` for training samples ``indices``."""
        raise NotImplementedError

    def test_batches(self, batch_size: int = 512):
        """Yield ``(inputs, targets)`` over the whole test set."""
        return iter(())

    def loss_sum(self, model, inputs, targets) -> tuple[Any, int | None]:
        """``(sum over samples of the per-sample loss, number of correct predictions or None)``."""
        raise NotImplementedError

    # -- factories --------------------------------------------------------------------------------
    @staticmethod
    def custom(
        model_fn: Callable[[], Any],
        train: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        test: Any = None,
        optimizer_fn: Callable[[Any, float], Any] | None = None,
        lr: float = 1e-3,
        batch_size: int = 64,
        classification: bool = False,
    ) -> "Workload":
        """A user workload.

        Args:
            model_fn: returns a new ``nn.Module`` (called after seeding torch, in every worker).
            train: a dataset: ``len(train)`` samples, ``train[i]`` -> ``(input, target)`` tensors,
                or a tuple ``(inputs, targets)`` of tensors with the samples along dim 0.
            loss_fn: ``loss_fn(outputs, targets)`` -> scalar mean loss over the batch
                (e.g. ``torch.nn.functional.cross_entropy``).
            test: optional test dataset, same forms as ``train``.
            optimizer_fn: ``optimizer_fn(params, lr)``; default Adam.
            classification: report accuracy as the argmax of the outputs' last dim.

        Raises:
            ValueError: the training set is empty.
        """
        return _CustomWorkload(model_fn, train, loss_fn, test, optimizer_fn, lr, batch_size, classification)


def get_workload(name: str | Workload = "digits", *, text: str | None = None, seed: int = 0) -> Workload:
    """The workload called ``name`` (or ``name`` itself if it is a :class:`Workload`); ``"llama"``
    is the ``tiny`` size (``LlamaWorkload(path, size="small")`` for the larger one).

    Raises:
        ValueError: an unknown name, or a text file that is empty or a folder.
        FileNotFoundError: ``text`` does not exist.
        ImportError: ``"llama"`` without transformers installed (the message says how to get it).
    """
    if isinstance(name, Workload):
        return name
    if name == "digits":
        return DigitsWorkload(seed)
    if name == "charlm":
        return CharLMWorkload(text or default_text_path())
    if name == "llama":
        return LlamaWorkload(text or default_text_path())
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or pass a Workload")


def load_digits_arrays() -> tuple[Any, Any]:
    """scikit-learn's bundled handwritten digits (UCI ML optical recognition of handwritten digits,
    as ``sklearn.datasets.load_digits``): ``(images, labels)``, float64 arrays of shape (1797, 64)
    (8x8 pixels, 0..16) and (1797,) (0..9).

    Read from scikit-learn's data file (``sklearn/datasets/data/digits.csv.gz``) without importing
    scikit-learn, which takes 1.5 s on a laptop before any proc can start; through
    ``load_digits()`` where the file is not where it is looked for.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ModuleNotFoundError("the digits workload reads scikit-learn's digits: pip install scikit-learn")
    for folder in spec.submodule_search_locations or ():
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


class DigitsWorkload(Workload):
    """MLP 64 -> 128 -> 10 on sklearn's digits; inputs scaled to [0, 1]."""

    name = "digits"
    default_lr = 3e-3
    default_batch = 64
    classification = True
    NUM_SAMPLES = 1797
    TEST_FRACTION = 0.2

    def __init__(self, seed: int = 0):
        import numpy as np

        # Loaded once here, on the controller, and pickled to the workers with the workload
        # (450 KB): a restarted rank then starts without reading it again.
        images, labels = load_digits_arrays()
        self.seed = seed
        self.num_test = int(round(len(labels) * self.TEST_FRACTION))
        self.num_train = len(labels) - self.num_test
        order = np.random.default_rng((seed, 7919)).permutation(len(labels))
        train, test = order[: self.num_train], order[self.num_train :]
        x = (images / 16.0).astype(np.float32)
        y = labels.astype(np.int64)
        self._arrays = (x[train], y[train], x[test], y[test])

    def setup(self) -> None:
        import torch

        self._x, self._y, self._tx, self._ty = (torch.from_numpy(a.copy()) for a in self._arrays)

    def build_model(self):
        from torch import nn

        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def train_batch(self, indices):
        import torch

        idx = torch.as_tensor(indices, dtype=torch.int64)
        return self._x[idx], self._y[idx]

    def test_batches(self, batch_size: int = 512):
        for i in range(0, len(self._ty), batch_size):
            yield self._tx[i : i + batch_size], self._ty[i : i + batch_size]

    def loss_sum(self, model, inputs, targets):
        import torch.nn.functional as F

        out = model(inputs)
        return F.cross_entropy(out, targets, reduction="sum"), int((out.argmax(-1) == targets).sum())


class CharLMWorkload(Workload):
    """A byte-level causal transformer LM; a sample is a window of ``context`` bytes."""

    name = "charlm"
    default_lr = 1e-3
    default_batch = 32
    classification = False
    TEST_FRACTION = 0.1

    def __init__(self, path: str, context: int = 64, d_model: int = 64, layers: int = 2, heads: int = 4):
        path = os.fspath(path)
        if os.path.isdir(path):
            raise ValueError(f"text file {path!r} is a folder; give the path of a text file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {path!r} does not exist")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"text file {path!r} is empty")
        if size < 2 * (context + 1) + 10:
            raise ValueError(f"text file {path!r} has {size} bytes; it needs at least {2 * (context + 1) + 10}")
        self.path = path
        self.context, self.d_model, self.layers, self.heads = context, d_model, layers, heads
        split = int(size * (1 - self.TEST_FRACTION))
        self.split = split
        self.num_train = split - context - 1
        self.num_test = size - split - context - 1

    def setup(self) -> None:
        import torch

        with open(self.path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(torch.int64)
        self._train, self._test = data[: self.split], data[self.split :]
        self._offsets = torch.arange(self.context + 1)

    def build_model(self):
        return _TinyTransformer(256, self.context, self.d_model, self.layers, self.heads)

    def _windows(self, data, starts):
        import torch

        win = data[torch.as_tensor(starts, dtype=torch.int64)[:, None] + self._offsets]
        return win[:, :-1], win[:, 1:]

    def train_batch(self, indices):
        return self._windows(self._train, indices)

    def test_batches(self, batch_size: int = 256):
        import torch

        # a fixed, evenly spaced subset of test windows keeps evaluation short
        starts = torch.linspace(0, self.num_test - 1, steps=min(self.num_test, 512)).long()
        for i in range(0, len(starts), batch_size):
            yield self._windows(self._test, starts[i : i + batch_size])

    def loss_sum(self, model, inputs, targets):
        import torch.nn.functional as F

        logits = model(inputs)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return per_token.view(targets.shape).mean(dim=1).sum(), None


class LlamaWorkload(CharLMWorkload):
    """A Llama-architecture causal LM over the bytes of a text: transformers' ``LlamaForCausalLM``
    built from :data:`LLAMA_SIZES` ``[size]`` with random init (the caller seeds torch), a
    256-entry byte vocabulary, untied embeddings, SDPA attention; samples and loss as ``charlm``
    (a window of ``context`` bytes, mean next-byte cross entropy per window, nats).

    Raises:
        ImportError: transformers is not installed (``pip install 'monarch_nb[llm]'``).
        ValueError: an unknown ``size``.
    """

    name = "llama"
    #: transformers' Llama takes ~2.6 s to import here: a spare that had to would make a group's
    #: rejoin ~3.7 s slower (llama-small, 2 cores)
    preload = ("transformers.models.llama.modeling_llama",)

    def __init__(self, path: str, size: str = "tiny", context: int = 64):
        import importlib.util

        if size not in LLAMA_SIZES:
            raise ValueError(f"unknown llama size {size!r}; choose one of {', '.join(LLAMA_SIZES)}")
        if importlib.util.find_spec("transformers") is None:
            raise ImportError("the llama workload needs transformers: pip install 'monarch_nb[llm]' "
                              "(or pip install 'transformers>=5,<6') in the environment of the procs")
        super().__init__(path, context=context)
        self.size = size

    def build_model(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        settings: dict[str, Any] = dict(vocab_size=256, max_position_embeddings=self.context, tie_word_embeddings=False,
                                        attn_implementation="sdpa", **LLAMA_SIZES[self.size])
        config = LlamaConfig(**settings)
        return _LogitsOnly(LlamaForCausalLM(config))


def _LogitsOnly(model):
    """``model(input_ids) -> logits`` of a transformers causal LM (its output object is a dict
    subclass that the loss and FSDP's hooks need not see)."""
    from torch import nn

    class LogitsOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    return LogitsOnly()


def _TinyTransformer(vocab: int, context: int, d_model: int, layers: int, heads: int):
    import torch
    from torch import nn

    class TinyTransformer(nn.Module):
        mask: torch.Tensor  # a registered buffer

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
            layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

        def forward(self, x):
            t = x.shape[1]
            h = self.embed(x) + self.pos[:t]
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.head(h)

    return TinyTransformer()


class _CustomWorkload(Workload):
    name = "custom"

    def __init__(self, model_fn, train, loss_fn, test, optimizer_fn, lr, batch_size, classification):
        self.model_fn, self.train, self.loss_fn, self.test = model_fn, train, loss_fn, test
        self.optimizer_fn = optimizer_fn
        self.default_lr, self.default_batch, self.classification = lr, batch_size, classification
        self.num_train = _length(train)
        if self.num_train == 0:
            raise ValueError("the training dataset is empty")

    def build_model(self):
        return self.model_fn()

    def build_optimizer(self, params, lr):
        return self.optimizer_fn(params, lr) if self.optimizer_fn else super().build_optimizer(params, lr)

    def train_batch(self, indices):
        return _gather(self.train, indices)

    def test_batches(self, batch_size: int = 512):
        if self.test is None:
            return
        n = _length(self.test)
        for i in range(0, n, batch_size):
            yield _gather(self.test, list(range(i, min(n, i + batch_size))))

    def loss_sum(self, model, inputs, targets):
        out = model(inputs)
        n = len(targets)
        correct = int((out.argmax(-1) == targets).sum()) if self.classification else None
        return self.loss_fn(out, targets) * n, correct


def _length(dataset) -> int:
    if isinstance(dataset, tuple) and len(dataset) == 2:
        return len(dataset[0])
    return len(dataset)


def _gather(dataset, indices):
    import torch

    if isinstance(dataset, tuple) and len(dataset) == 2:
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        return dataset[0][idx], dataset[1][idx]
    pairs = [dataset[int(i)] for i in indices]
    return torch.stack([torch.as_tensor(p[0]) for p in pairs]), torch.stack([torch.as_tensor(p[1]) for p in pairs])
