"""Request parsing and validation, image decoding and preprocessing bounds, remote images. May
import generation (sampling parameters), models, cache and the bottom layer; never actors or above."""
