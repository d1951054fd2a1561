"""Multi-LoRA serving: PEFT adapters applied per request in a mixed batch.

Only :mod:`fastsched.lora.request` is imported here, so that the frontend and the
gateway can name adapters without loading torch; the engine imports
:mod:`~fastsched.lora.adapter`, :mod:`~fastsched.lora.punica` and
:mod:`~fastsched.lora.slots` itself.
"""

from fastsched.lora.request import LoRARequest, read_adapter_config

__all__ = ["LoRARequest", "read_adapter_config"]
