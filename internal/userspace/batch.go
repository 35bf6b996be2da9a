package userspace

import (
	"net"
	"sync/atomic"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// The client->peer shortcut sends in batches: while the listener socket
// still holds datagrams of the recvmmsg batch it read (udpio.BatchConn), the
// ChannelData the shortcut relays is written through the relay socket's
// wrappers as before (the peer port filter, the traffic counters, the rate
// limit's charge, the IP header fields, the counters), but the innermost
// socket (udpio.Conn) leaves the datagram in the read loop's udpio.SendBatch
// instead of sending it. The batch goes out, one sendmmsg per relay socket in
// the order written, before the read loop could wait: when the listener
// socket's batch is used up, and before any datagram goes to pion (whose own
// writes then follow the shortcut's, as they would one by one). Nothing is
// held across a read that blocks.
//
// A deferred write that fails leaves its datagram to pion, as a write that
// fails does without batches: the read loop hands it to pion (with its source
// and IP header fields), and every later one to the same relay socket after
// it, in order, before anything else; the counters take back what relayConn
// counted for them. Only the traffic counters' bytes (internal/metrics),
// counted as the write returned, are not taken back.

// slotSize holds any datagram pion reads (its buffer is 1600 bytes).
const slotSize = 2048

// sendBatch is one read loop's batch: the deferred datagrams' copies (their
// data must outlive the read loop's buffer, which the next read reuses) and
// what handing one to pion needs.
type sendBatch struct {
	b      *udpio.SendBatch
	listen *udpio.BatchConn // Buffered: is the read loop's next read a system call?
	slots  []byte           // udpio.BatchSize slots of slotSize, made on first use
	ents   [udpio.BatchSize]deferred
	failed func(tag int, err error) // markFailed, bound once

	// back is what goes to pion before the read loop reads again, in order:
	// indexes into ents, or udpio.BatchSize for cur.
	back    [udpio.BatchSize + 1]int
	nBack   int
	nextBck int
	cur     deferred // the datagram the read loop was to hand pion as the batch failed
	curData []byte

	sent atomic.Uint64 // datagrams sent from the batch (tests)
}

// deferred is a datagram the shortcut relayed into the batch.
type deferred struct {
	n      int // the ChannelData datagram's length
	src    net.Addr
	fields uint32 // udpio.Fields.Pack, as the read loop read it
	rc     *relayConn
	data   int // what relayConn counted
	failed bool
	err    error // cur's read error
}

func newSendBatch(listen *udpio.BatchConn) *sendBatch {
	d := &sendBatch{b: udpio.NewSendBatch(), listen: listen}
	d.failed = d.markFailed
	return d
}

func (d *sendBatch) markFailed(tag int, _ error) { d.ents[tag].failed = true }

// relayDeferred relays ChannelData p from src (data length bytes after its
// header) on route r into the batch; see Channels.relay.
func (t *Channels) relayDeferred(p []byte, src net.Addr, r route, length int) bool {
	d := t.batch
	if d.slots == nil {
		d.slots = make([]byte, udpio.BatchSize*slotSize)
	}
	i := d.b.Len()
	slot := d.slots[i*slotSize : i*slotSize+len(p)]
	copy(slot, p)
	data := slot[4 : 4+length]
	if !r.conn.Defer(d.b, i) {
		return false
	}
	n, err := r.relay.WriteTo(data, r.peer)
	queued := r.conn.Disarm()
	if err != nil || n != len(data) {
		// Failed before it reached the batch (or a wrapper failed it
		// after): pion's, as without batches.
		if queued {
			d.b.Drop(i)
		}
		return false
	}
	if !queued {
		// Dropped on the way (rate limit, TTL): relayed, as without batches.
		t.counters.ShortcutPackets.Add(1)
		return true
	}
	d.ents[i] = deferred{n: len(p), src: src, fields: t.cur.fields.Load(), rc: r.raw, data: n}
	return true
}

// mustFlush reports whether the batch must go out before the read loop reads
// again: it holds datagrams and the next read may wait (or it is full).
func (t *Channels) mustFlush() bool {
	d := t.batch
	return d != nil && d.b.Len() > 0 && (d.b.Full() || d.listen.Buffered() == 0)
}

// pending reports whether the batch holds datagrams.
func (t *Channels) pending() bool { return t.batch != nil && t.batch.b.Len() > 0 }

// flush sends the batch and queues what failed for pion.
func (t *Channels) flush() {
	d := t.batch
	n := d.b.Len()
	d.b.Flush(d.failed)
	var sent uint64
	for i := range n {
		e := &d.ents[i]
		if e.failed {
			// relayConn counted it as written: pion will count it when it is.
			e.rc.counters.ClientToPeerPackets.Add(^uint64(0))
			e.rc.counters.ClientToPeerBytes.Add(^uint64(e.data - 1))
			d.back[d.nBack] = i
			d.nBack++
			continue
		}
		sent++
		*e = deferred{}
	}
	t.counters.ShortcutPackets.Add(sent)
	d.sent.Add(sent)
}

// handingBack reports whether datagrams wait to go to pion.
func (t *Channels) handingBack() bool { return t.batch != nil && t.batch.nextBck < t.batch.nBack }

// queueBack puts the datagram the read loop read (p, from src, or its read
// error) after those waiting to go to pion.
func (t *Channels) queueBack(p []byte, src net.Addr, err error) {
	d := t.batch
	d.curData = append(d.curData[:0], p...)
	d.cur = deferred{n: len(p), src: src, fields: t.cur.fields.Load(), err: err}
	d.back[d.nBack] = udpio.BatchSize
	d.nBack++
}

// handBack copies the next datagram waiting to go to pion into p, with the
// read loop's current source and fields as they were when it was read.
func (t *Channels) handBack(p []byte) (int, net.Addr, bool, error) {
	d := t.batch
	if d == nil || d.nextBck == d.nBack {
		return 0, nil, false, nil
	}
	i := d.back[d.nextBck]
	d.nextBck++
	if d.nextBck == d.nBack {
		d.nextBck, d.nBack = 0, 0
	}
	var e deferred
	var n int
	if i == udpio.BatchSize {
		e, d.cur = d.cur, deferred{}
		n = copy(p, d.curData[:e.n])
	} else {
		e, d.ents[i] = d.ents[i], deferred{}
		n = copy(p, d.slots[i*slotSize:i*slotSize+e.n])
	}
	if e.err == nil {
		u, _ := e.src.(*net.UDPAddr)
		t.cur.src.Store(u)
		t.cur.fields.Store(e.fields)
	}
	return n, e.src, true, e.err
}
