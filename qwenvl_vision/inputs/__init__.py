"""From files to patches: headers and decoding limits (``pixels``), the image processor (``images``), video frames
and their sampling (``video``, ``video_io``), and the content identity of an item (``item_ids``)."""
