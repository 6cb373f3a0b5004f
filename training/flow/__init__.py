"""π0.5 flow-matching training: the jitted train step (`train_step`, data parallel on one or several processes)
and training-time real-time chunking (`rtc`)."""
