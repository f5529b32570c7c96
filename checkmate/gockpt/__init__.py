"""GoCkpt mode: the trainer side (slices, gradients, restore) and the CPU worker."""
