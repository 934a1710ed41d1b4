"""The HTTP/2 the builtin gRPC server speaks, one concept a module.

``frames``: the frame format and its codes. ``headers``: header blocks (HPACK, request
header checks). ``grpc_wire``: gRPC's messages, response headers and trailers on HTTP/2.
``connection``: one client connection's state (settings, flow control, streams).
"""
