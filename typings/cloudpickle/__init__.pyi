# What monarch_nb uses of cloudpickle, which ships no types (mypy reads this through mypy_path).
import pickle
from typing import Any

class CloudPickler(pickle.Pickler): ...

def dumps(obj: Any, protocol: int | None = None, buffer_callback: Any = None) -> bytes: ...
