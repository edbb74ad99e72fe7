"""The file format: what a push reads (source, hfcache, safetensors), how it is cut and named
(chunking, hashing), described (manifest), encoded (codec) and sent (wire), and how files are
rebuilt from chunks and checked (rebuild, filecheck, durable). Shared by the store and the node
client. See docs/design/format.md."""
