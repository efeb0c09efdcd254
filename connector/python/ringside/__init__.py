"""ringside Python connector: a client for ringside's shared-memory ring.

See ringside.ring for the ring itself (layout version 1, byte-compatible with
the Go package github.com/ringside-kv/ringside/ring).
"""

from .client import (  # noqa: F401,E402
    DEFAULT_SOCKET,
    RingsideError,
    RingsideTimeout,
    RingsideUnavailable,
    Session,
)
from .ring import (  # noqa: F401
    ALIGN,
    FLAG_CREATOR_PRODUCER,
    HEADER_SIZE,
    MAGIC,
    MAX_CAPACITY,
    MIN_CAPACITY,
    RECORD_HEADER_SIZE,
    TYPE_PAD,
    VERSION,
    Consumer,
    Header,
    Producer,
    Record,
    Ring,
    RingBadHeader,
    RingBadType,
    RingClosed,
    RingCorrupt,
    RingError,
    RingFull,
    RingPeerClosed,
    RingPeerDead,
    RingTimeout,
    RingTooLarge,
    WaitConfig,
    create,
    decode_header,
    decode_record_header,
    default_max_record,
    encode_header,
    encode_record,
    encode_record_header,
    open_ring,
    process_alive,
    process_start_time,
    record_size,
)
