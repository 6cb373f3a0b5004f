"""Training, in three drawers and one module (docs/memory_lora.md):

    data/           frames and where they come from: the frame storage format (`frames`), RLDS TFRecord
                    reading (`rlds_tfrecord`), LeRobot datasets (`lerobot/`), OxyGen's LIBERO annotations
                    (`oxygen_libero/`), LIBERO frames rendered without demonstrations (`libero/`, a command:
                    `python -m training.data.libero`) and a synthetic task with a known answer (`synthetic_memory`)
    memory/         the textual-memory LoRA trainer (`python -m training.memory`) and its batches
    flow/           π0.5 flow-matching training: the train step (`train_step`) and training-time RTC (`rtc`)
    distributed.py  several processes training one run (docs/multihost.md)
"""
