"""Training: the textual-memory LoRA trainer (`python -m training.memory`), LIBERO memory frames without
demonstrations (`python -m training.libero`), memory datasets without TensorFlow (`memory_data`,
`rlds_tfrecord`, `synthetic_memory`) and a flow-matching train step (`train_step`); docs/memory_lora.md."""
