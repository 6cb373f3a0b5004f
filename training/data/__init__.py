"""Robot frames for training and evaluation, and where they come from; no trainer imports live here.

    frames          the frame dict and its storage format (one-step RLDS episodes as array_record, no TensorFlow)
    rlds_tfrecord   RLDS datasets as TFDS TFRecord shards (LIBERO, DROID), read without TensorFlow
    lerobot/        LeRobot v3.0 / v2.x datasets (docs/lerobot.md)
    oxygen_libero/  OxyGen's textual-memory annotations on LIBERO's raw HDF5 demonstrations
    libero/         LIBERO memory frames rendered in the simulator without demonstrations, labelled from the
                    tasks' BDDL goals (`bddl_goals`); writes `frames` datasets
    synthetic_memory  a synthetic memory task with a known answer, written as a `frames` dataset
"""
