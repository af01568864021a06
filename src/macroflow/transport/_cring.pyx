# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled core of a shared-memory ring (see :mod:`macroflow.transport.ring`).

:class:`Core` is the base class of ``ring.Ring`` when this module is built:
the writer's ``put`` and ``send1`` and the reader's ``drain``, the steps
every small frame takes, as C over the ring's mapping. ``ring._PyCore`` is
the same in Python, used where no compiler built this module (or with
``MACROFLOW_COMPILED=0``); the two are tested against each other.

Memory order: as the module ``ring`` says, entries are written before the
TAIL that announces them and TAIL before BELL; here the compiler is told so
(release stores, acquire loads), and the sleep hand-shake's store-then-load
has a full fence between.
"""

from libc.stdint cimport int32_t, int64_t, uint32_t
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

cdef extern from *:
    """
    static inline int64_t mf_load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void mf_store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline void mf_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    """
    int64_t mf_load(int64_t *p) nogil
    void mf_store(int64_t *p, int64_t v) nogil
    void mf_fence() nogil

# the layout of ring.py: word indexes, offsets, entry kinds
cdef enum:
    HEAD = 0
    TAIL = 16
    BELL = 0
    NAP = 16
    DATA = 256
    WRAP = -1
    MANY = -3
    BULK = -4

#: drain's result: (frames delivered << 4) | what stopped it
EMPTY = 0  # the ring is empty (HEAD stored)
HELD = 15  # the peer is in ``held``: the rest is read entry by entry
# otherwise the kind (-n) of the entry at ``pos``, not consumed: MARK 2, MANY 3, BULK 4, POKE 5


cdef class Core:
    """A ring's positions, and its frames' common steps in C. Made by
    ``Ring``, which calls :meth:`_attach` with its mapping."""

    cdef public int64_t pos
    cdef public int64_t seen
    cdef char *base  # the ring's mapping: HEAD, TAIL, then the entries from DATA
    cdef int64_t *bell  # the reader's first page: BELL and NAP
    cdef int64_t ccap, cmask, cident

    def _attach(self, size_t addr, size_t bell_addr, int64_t cap, int64_t ident):
        self.base = <char *>addr
        self.bell = <int64_t *>bell_addr
        self.ccap = cap
        self.cmask = cap - 1
        self.cident = ident

    def _detach(self):
        self.base = NULL
        self.bell = NULL

    cdef inline int _open(self) except -1:
        if self.base == NULL:
            raise ValueError("the ring is closed")
        return 0

    cdef int64_t _claim_c(self, int64_t n):
        cdef int64_t need = 8 + ((n + 7) & -8)
        cdef int64_t tail = self.pos
        cdef int64_t off = tail & self.cmask
        cdef int64_t end = self.ccap - off
        cdef int64_t *words = <int64_t *>self.base
        if need > end:
            if tail + end + need - self.seen > self.ccap:
                self.seen = mf_load(words + HEAD)
                if tail + end + need - self.seen > self.ccap:
                    return -1
            (<int32_t *>(self.base + DATA + off))[0] = WRAP
            (<uint32_t *>(self.base + DATA + off + 4))[0] = 0
            self.pos = tail + end
            return DATA
        if tail + need - self.seen > self.ccap:
            self.seen = mf_load(words + HEAD)
            if tail + need - self.seen > self.ccap:
                return -1
        return DATA + off

    cdef inline void _publish_c(self, int64_t n):
        cdef int64_t tail = self.pos + 8 + ((n + 7) & -8)
        self.pos = tail
        mf_store(<int64_t *>self.base + TAIL, tail)
        mf_store(self.bell + BELL, self.cident + tail)

    def _claim(self, int64_t n):
        self._open()
        return self._claim_c(n)

    def _publish(self, int64_t n):
        self._open()
        self._publish_c(n)

    cdef int _put(self, object data, int64_t load, int kind) except -1:
        cdef Py_buffer view
        cdef int64_t n, base
        self._open()
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            n = view.len
            base = self._claim_c(n)
            if base < 0:
                return 0
            if n:
                memcpy(self.base + base + 8, view.buf, n)
            if kind:
                (<int32_t *>(self.base + base))[0] = kind
                (<uint32_t *>(self.base + base + 4))[0] = \
                    <uint32_t>(n if kind == MANY or kind == BULK else load)
            else:
                (<int32_t *>(self.base + base))[0] = <int32_t>n
                (<uint32_t *>(self.base + base + 4))[0] = <uint32_t>load
            self._publish_c(n)
            return 1
        finally:
            PyBuffer_Release(&view)

    def put(self, data, int64_t load, int kind=0):
        """Write one entry (see ``ring.Ring.put``); False if it does not fit now."""
        return self._put(data, load, kind) == 1

    def send1(self, data, int64_t load):
        """Write a frame of one buffer, then look at the reader's NAP (after
        a fence): 0 if it does not fit now (nothing written), 1 written, 2
        written and the reader may be asleep (NAP is set: wake it)."""
        if self._put(data, load, 0) == 0:
            return 0
        mf_fence()
        return 2 if mf_load(self.bell + NAP) else 1

    def drain(self, deliver, peer, held=None):
        """Reader: hand every frame of one buffer to ``deliver(peer, [bytes],
        load)``, from ``pos`` until the ring is empty or an entry of another
        kind (left at ``pos``) comes; see EMPTY and HELD for the result.
        With ``held`` (a container), stop after a frame once ``peer`` is in
        it: what follows must queue behind what it waits for."""
        cdef int64_t head, tail, off, n, count = 0
        cdef int32_t k
        cdef uint32_t load
        cdef int64_t *words
        cdef char *p
        self._open()
        words = <int64_t *>self.base
        head = self.pos
        while True:
            tail = mf_load(words + TAIL)
            if head == tail:
                mf_store(words + HEAD, head)
                return count << 4
            while head != tail:
                off = head & self.cmask
                p = self.base + DATA + off
                k = (<int32_t *>p)[0]
                if k >= 0:
                    load = (<uint32_t *>(p + 4))[0]
                    n = k
                    data = PyBytes_FromStringAndSize(p + 8, n)
                    head += 8 + ((n + 7) & -8)
                    self.pos = head
                    deliver(peer, [data], load)
                    count += 1
                    if self.base == NULL:
                        return (count << 4) | HELD  # closed by what it delivered
                    if held is not None and peer in held:
                        mf_store(words + HEAD, head)
                        return (count << 4) | HELD
                elif k == WRAP:
                    head += self.ccap - off
                    self.pos = head
                else:
                    mf_store(words + HEAD, head)
                    return (count << 4) | (-k)
            # free the room only after the batch (the writer reads HEAD only when full)
            mf_store(words + HEAD, head)
