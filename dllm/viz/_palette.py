"""The commit-step colour scale shared by the PNG and the HTML page: viridis (public domain, CC0) sampled at 17
evenly spaced stops, 8-bit RGB; the pictures interpolate between them."""

VIRIDIS = [
    (68, 1, 84), (72, 24, 106), (71, 45, 123), (66, 64, 134), (59, 82, 139), (51, 99, 141),
    (44, 114, 142), (38, 130, 142), (33, 145, 140), (31, 160, 136), (40, 174, 128), (63, 188, 115),
    (94, 201, 98), (132, 212, 75), (173, 220, 48), (216, 226, 25), (253, 231, 37),
]
