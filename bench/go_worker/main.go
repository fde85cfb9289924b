// A lean rollout worker for bench/buffer_throughput.py: the same calls as a Python worker
// there (AcquireSlot; puts on one PutGroups stream, each asking for its next slot; the puts
// that meet go as one message), with a fraction of its CPU, as redis-benchmark's C clients
// load Redis. It lets the bench measure what the buffer sustains when its clients do not
// share its two cores with 128 Python interpreters.
//
//	go-worker -address 127.0.0.1:50051 -job bench -name w0 -group group.bin \
//	    -version version.bin -seconds 10 -in-flight 1
//
// It prints "ready" once it holds its first slots, starts on a line on stdin, and prints
// "put N" (groups put) when done. Generation takes no time; each group's response tokens are
// stamped with the version in the -version file (an int64 the bench's trainer updates).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"asyncrl.dev/bench/go_worker/pb"
)

// As the Python client's PUT_MESSAGE_BYTES: the most bytes of groups one message carries.
const putMessageBytes = 8 << 20

type put struct {
	slot  string
	group []byte
	reply chan string // the next slot ("" when not granted)
}

type worker struct {
	job, name string
	buffer    pb.BufferClient
	conn      *grpc.ClientConn
	puts      chan put
	version   *int64 // shared with the bench's trainer through a mapped file
}

func main() {
	address := flag.String("address", "", "the buffer's host:port")
	job := flag.String("job", "", "job name")
	name := flag.String("name", "", "this worker's name")
	groupFile := flag.String("group", "", "an encoded Group (as EncodedGroup) to put")
	versionFile := flag.String("version", "", "8-byte file holding the current version")
	seconds := flag.Float64("seconds", 10, "how long to put")
	inFlight := flag.Int("in-flight", 1, "groups under way at once")
	flag.Parse()
	// One thread runs the worker's Go code, as one runs redis-benchmark's: with a hundred
	// workers on two cores, more only add scheduler wake-ups (a lone worker: 270 against 360
	// us of CPU per 55 KB put).
	runtime.GOMAXPROCS(1)
	log.SetPrefix(*name + ": ")
	log.SetFlags(0)

	template := &pb.EncodedGroup{}
	data, err := os.ReadFile(*groupFile)
	if err != nil {
		log.Fatal(err)
	}
	if err := proto.Unmarshal(data, template); err != nil {
		log.Fatalf("%s: %v", *groupFile, err)
	}
	conn, err := grpc.NewClient(*address, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)),
		grpc.WithInitialWindowSize(16<<20), grpc.WithInitialConnWindowSize(16<<20))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	w := &worker{job: *job, name: *name, buffer: pb.NewBufferClient(conn), conn: conn,
		puts: make(chan put, *inFlight), version: mapVersion(*versionFile)}

	slots := make([]string, *inFlight)
	for i := range slots {
		if slots[i] = w.acquire(time.Now().Add(time.Minute)); slots[i] == "" {
			log.Fatal("no slot granted within a minute")
		}
	}
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		log.Fatalf("waiting for the start: %v", err)
	}
	deadline := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	go w.send()
	var count atomic.Int64
	var rollouts sync.WaitGroup
	for i, slot := range slots {
		rollouts.Add(1)
		go func() {
			defer rollouts.Done()
			w.rollouts(proto.Clone(template).(*pb.EncodedGroup), slot, deadline, &count, i)
		}()
	}
	rollouts.Wait()
	fmt.Printf("put %d\n", count.Load())
}

// mapVersion maps the bench's version file, which its trainer writes in place.
func mapVersion(path string) *int64 {
	file, err := os.Open(path)
	if err != nil {
		log.Fatal(err)
	}
	defer file.Close()
	mapped, err := syscall.Mmap(int(file.Fd()), 0, 8, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		log.Fatalf("mapping %s: %v", path, err)
	}
	return (*int64)(unsafe.Pointer(&mapped[0]))
}

// acquire waits at the staleness gate for a slot, as BufferClient.acquire does (and, at the
// start, for the buffer to listen), until `deadline`: "" if none was granted by then (the
// gate stays shut once the bench's trainer has stopped).
func (w *worker) acquire(deadline time.Time) string {
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		reply, err := w.buffer.AcquireSlot(ctx, &pb.AcquireSlotRequest{Job: w.job, Worker: w.name},
			grpc.WaitForReady(true))
		cancel()
		if status.Code(err) == codes.DeadlineExceeded {
			break
		}
		if err != nil {
			log.Fatalf("AcquireSlot: %v", err)
		}
		if reply.Granted {
			return reply.SlotId
		}
		time.Sleep(time.Duration(max(reply.RetryAfterMs, 20)) * time.Millisecond)
	}
	return ""
}

// rollouts puts groups until the deadline, each with the slot the last put was granted (or
// one acquired), then gives back the slot it holds.
func (w *worker) rollouts(group *pb.EncodedGroup, slot string, deadline time.Time,
	count *atomic.Int64, index int) {
	stamped := int64(-1)
	for n := 0; time.Now().Before(deadline); n++ {
		if slot == "" {
			if slot = w.acquire(deadline); slot == "" {
				break
			}
		}
		if version := atomic.LoadInt64(w.version); version != stamped {
			stamped = version
			stamp(group, version)
		}
		group.GroupId = fmt.Sprintf("%s-%d-%d", w.name, index, n)
		encoded, err := proto.Marshal(group)
		if err != nil {
			log.Fatal(err)
		}
		reply := make(chan string, 1)
		w.puts <- put{slot, encoded, reply}
		slot = <-reply
		count.Add(1)
	}
	if slot != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := w.buffer.ReleaseSlot(ctx, &pb.ReleaseSlotRequest{
			Job: w.job, SlotId: slot, Reason: "stopping"}); err != nil {
			log.Fatalf("ReleaseSlot: %v", err)
		}
	}
}

// stamp marks every response token as generated by `version` (one packed varint each).
func stamp(group *pb.EncodedGroup, version int64) {
	one := binary.AppendUvarint(nil, uint64(version))
	for _, sample := range group.Samples {
		tokens := len(sample.BehaviourLogprobs[0]) / 4
		sample.TokenVersions = [][]byte{bytes.Repeat(one, tokens)}
	}
}

// send writes the puts on one PutGroups stream, one message at a time: the puts waiting when
// a message goes (up to putMessageBytes) go in it, and each gets its own answer. Its messages
// are EncodedPutGroupsRequest, PutGroupsRequest's wire format with each group's bytes as they
// are, so the stream is opened by name rather than through the typed stub.
func (w *worker) send() {
	stream, err := w.conn.NewStream(context.Background(), &pb.Buffer_ServiceDesc.Streams[0],
		pb.Buffer_PutGroups_FullMethodName)
	if err != nil {
		log.Fatalf("PutGroups: %v", err)
	}
	for first := range w.puts {
		batch, size := []put{first}, len(first.group)
	gather:
		for size < putMessageBytes {
			select {
			case next := <-w.puts:
				batch, size = append(batch, next), size+len(next.group)
			default:
				break gather
			}
		}
		request := &pb.EncodedPutGroupsRequest{}
		for _, p := range batch {
			request.Puts = append(request.Puts, &pb.EncodedPutGroupRequest{
				Job: w.job, SlotId: p.slot, Group: p.group, AcquireNext: true, Worker: w.name})
		}
		if err := stream.SendMsg(request); err != nil {
			log.Fatalf("PutGroups send: %v", err)
		}
		reply := &pb.PutGroupsResponse{}
		if err := stream.RecvMsg(reply); err != nil {
			log.Fatalf("PutGroups receive: %v", err)
		}
		for i, result := range reply.Results {
			if result.Code != 0 {
				log.Fatalf("put refused (code %d): %s", result.Code, result.Message)
			}
			next := ""
			if result.Response.NextSlot.GetGranted() {
				next = result.Response.NextSlot.SlotId
			}
			batch[i].reply <- next
		}
	}
}
