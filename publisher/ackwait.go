package publisher

import "time"

// maxAckWait bounds how long an attempt may wait for its answer when the
// broker's answers come later than AckTimeout (an AckTimeout set above it
// is kept): a message lost on its way (a connection reset) is re-sent
// after at most this long.
const maxAckWait = time.Minute

// ackWait is how long Run waits for an attempt's answer before sending the
// message again: AckTimeout while the broker answers in time, longer while
// it answers later than that. Each answer is matched to the attempt it
// answers by its reply token, so its round trip is known exactly, late
// ones included, and feeds a smoothed round trip and its variation as TCP
// derives its retransmission timeout from them (RFC 6298): the wait is
// srtt + 4·rttvar, at least AckTimeout, at most max(AckTimeout,
// maxAckWait).
//
// Why it adapts: a broker that takes messages more slowly than the
// publisher offers them answers from a backlog, in arrival order. Re-sent
// on a fixed AckTimeout, hundreds of waiting messages each added an
// attempt to that backlog every AckTimeout + backoff, so it, and every
// answer's delay, kept growing, and the server spent its time on
// duplicates. Waiting as long as answers actually take lets the backlog
// drain. Only Run touches it.
type ackWait struct {
	floor, ceil  time.Duration
	srtt, rttvar time.Duration
	sampled      bool
}

func newAckWait(ackTimeout time.Duration) ackWait {
	return ackWait{floor: ackTimeout, ceil: max(ackTimeout, maxAckWait)}
}

// sample takes the round trip of one answered attempt.
func (w *ackWait) sample(rtt time.Duration) {
	if !w.sampled {
		w.srtt, w.rttvar, w.sampled = rtt, rtt/2, true
		return
	}
	dev := w.srtt - rtt
	if dev < 0 {
		dev = -dev
	}
	w.rttvar += (dev - w.rttvar) / 4
	w.srtt += (rtt - w.srtt) / 8
}

// wait returns how long an attempt waits for its answer now.
func (w *ackWait) wait() time.Duration {
	d := w.srtt + 4*w.rttvar
	return min(max(d, w.floor), w.ceil)
}
