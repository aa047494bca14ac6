"""What a LoRA adapter is, with no serving state: its math in the model and its formats.

    apply.py         the one seam where the LoRA term enters the model (kernels: jaxlora.kernels)
    bank.py          the device bank's layout `[L, S, ...]` per layer group, and slot writes
    host_adapter.py  one validated adapter in host memory, ready for a slot
    peft_format.py   Hugging Face PEFT folders <-> HostAdapter
    validate.py      checks shared by every way an adapter enters
    merge.py         folding an adapter into the base weights

Which adapter sits in which slot, and when it is paged in, is `jaxlora.adapters`' business; this
package never imports it.
"""
