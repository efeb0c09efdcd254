"""LogFollower: the one loop under the local index (Mirror) and the KV events
feed (EventFeed), driven here by a scripted session and a toy follower."""

from ringside.follow import LogFollower


class FakeSession:
    """Records submits; replies are handed out when the test says so."""

    def __init__(self):
        self.seq = 0
        self.sent = []  # (seq, type, payload, wake)
        self.replies = {}  # seq -> payload, once answered
        self.forgotten = []
        self.awaited = []

    def submit(self, typ, payload, wake=True):
        self.seq += 1
        self.sent.append((self.seq, typ, payload, wake))
        return self.seq

    def try_reply(self, seq):
        return self.replies.pop(seq, None)

    def await_reply(self, seq, timeout=None, keep=False):
        self.awaited.append((seq, timeout))
        return self.replies.pop(seq, None)

    def forget(self, seq):
        self.forgotten.append(seq)

    def answer(self, payload=b"r"):
        self.replies[self.sent[-1][0]] = payload


class Toy(LogFollower):
    """Pages until one says done, then polls; a poll reply "head" ends the call."""

    def __init__(self, timeout=1.0):
        super().__init__(timeout, {"lost_replies": 0})
        self.begun = []
        self.applied = []
        self.syncing = False

    def _begin(self, s):
        self.begun.append(s)
        self.session = s
        self.pending = 0
        self.syncing = True

    def _request(self):
        return (1, b"page") if self.syncing else (2, b"poll")

    def _apply(self, p, sent_t):
        self.applied.append((p, sent_t))
        if p == b"done":
            self.syncing = False
        return p == b"head"


def test_one_request_in_flight_collected_at_the_next_call():
    f, s = Toy(), FakeSession()
    f.pump(s)
    assert f.begun == [s] and [x[1:] for x in s.sent] == [(1, b"page", False)] and f.pending == 1
    t1 = f.pending_t
    f.pump(s)  # not answered: nothing more is sent
    assert len(s.sent) == 1 and f.applied == []
    s.answer(b"done")
    f.pump(s)  # the page is applied, the first poll sent
    assert f.applied == [(b"done", t1)] and f.sent_t == f.pending_t >= t1
    assert [x[1:3] for x in s.sent] == [(1, b"page"), (2, b"poll")] and f.pending == 2


def test_a_reply_that_ends_the_call_sends_nothing_more():
    f, s = Toy(), FakeSession()
    f.pump(s)
    s.answer(b"done")
    f.pump(s)
    s.answer(b"head")
    f.pump(s, budget_ns=10**9, wake=True)  # a budget, but the poll's reply ends the call
    assert len(s.sent) == 2 and f.pending == 0 and f.applied[-1][0] == b"head"


def test_within_a_budget_requests_go_on_and_wake():
    f, s = Toy(), FakeSession()
    s.await_reply = lambda seq, timeout=None, keep=False: b"more" if seq < 3 else None
    f.pump(s, budget_ns=50_000_000)
    # Pages applied while the budget lasts, each sent with a wake; the last
    # one stays in flight when the budget runs out.
    assert len(s.sent) >= 3 and all(w for *_, w in s.sent)
    assert [p for p, _ in f.applied] == [b"more", b"more"]


def test_an_unanswered_request_is_asked_again_after_the_timeout():
    f, s = Toy(timeout=0.0), FakeSession()
    f.pump(s)
    f.pump(s)  # past the timeout: forgotten, asked again
    assert s.forgotten == [1] and f.stats["lost_replies"] == 1 and [x[0] for x in s.sent] == [1, 2]


def test_a_new_session_begins_again_and_disabled_stops():
    f, s1, s2 = Toy(), FakeSession(), FakeSession()
    f.pump(s1)
    f.pump(s2)
    assert f.begun == [s1, s2] and len(s2.sent) == 1
    f.disabled = "off"
    s2.answer()
    f.pump(s2)
    assert len(s2.sent) == 1 and f.applied == []
