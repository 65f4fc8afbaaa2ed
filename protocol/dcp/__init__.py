"""DCP, sans-IO: constants, the memcached binary framing, every DCP message (decode and
encode), the columnar batch decoder used by captures, and the consumer and producer state
machines."""
