"""Vision encoders: the image side of a vision-language family (models/families/).

An encoder turns an image's flattened patches (``pixel_values`` [patches, C*T*P*P], as the
model's image processor writes them) and its patch grid (``image_grid_thw`` [images, 3])
into one feature row per image token of the language model, which the decoder scatters into
the image-pad positions. Its shape is a :class:`~hybridflow.models.vision.spec.VisionSpec`.
"""
