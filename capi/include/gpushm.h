/* SPDX-License-Identifier: MPL-2.0 */
/*
 * gpushm.h: the C API of gpushm (libgpushm.so). Generated from capi/src/ by cbindgen
 * (make capi-header): do not edit.
 *
 * Thread safety: every function may be called from any thread. Calls on one subscriber take
 * turns (one waiting for a frame holds the others back; gpushm_subscriber_interrupt does not
 * wait). Frames, slots and publishers may be used from any thread, one call at a time per
 * handle being the simplest rule; a frame's pointers are valid in every thread until it is
 * released. Handles are ids, not memory: a stale or foreign one is GPUSHM_ERROR_BAD_HANDLE.
 *
 * Build: cc app.c $(pkg-config --cflags --libs gpushm)
 */

#ifndef GPUSHM_H
#define GPUSHM_H

#include <stdint.h>
#include <stddef.h>


// A timestamp that is not set (PTS, DTS, duration).
#define GPUSHM_TIME_NONE UINT64_MAX

// Planes described at most.
#define GPUSHM_MAX_PLANES 4

// A held request that keeps the CPUs out of deep idle states
// (`gpushm_cpu_latency_request`).
typedef struct gpushm_cpu_latency gpushm_cpu_latency;

// A frame received: its slot is never reused by the producer until `gpushm_frame_release` (or
// `gpushm_frame_destroy`), even after its subscriber is destroyed or its producer dies, with
// one exception: a producer that must go on cuts a consumer that held every slot of its ring
// for 0.5 s without giving one back (more than its fair share), and takes its slots back.
// `gpushm_frame_is_valid` then says 0 and calls on the frame return GPUSHM_ERROR_REVOKED.
// Keep fewer frames than the ring has slots (or copy what you keep) and it never happens.
typedef struct gpushm_frame gpushm_frame;

// A publisher: serves frames at a socket path to any number of subscribers and gpushmsrc.
typedef struct gpushm_publisher gpushm_publisher;

// A free slot lent by a publisher, to fill and then publish (or discard).
typedef struct gpushm_slot gpushm_slot;

// A subscriber: one connection to a producer (a gpushmsink or a publisher).
typedef struct gpushm_subscriber gpushm_subscriber;

// What every function returns: `GPUSHM_OK` (0), a positive outcome that is not an error
// (`GPUSHM_TIMEOUT`, `GPUSHM_EOS`, `GPUSHM_INTERRUPTED`), or a negative error code.
typedef int gpushm_status;

// How a subscriber receives frames. Fill it with `gpushm_subscriber_options_init` first.
// Until gpushm 1.0 the option structs may grow at their end from one release to the next
// (spin_us came so): build against the gpushm.h of the libgpushm you run with.
typedef struct {
  // 0: auto (lossless from a producer that is not live, newest frames from a live one),
  // 1: lossless (the producer waits for this consumer), 2: leaky (newest frames, never
  // waited for).
  int mode;
  // How long `gpushm_subscriber_open` waits for a producer to appear, and a reconnect for
  // one to come back, in nanoseconds.
  int64_t connect_timeout_ns;
  // Accept frames only from a producer running as this user id. -1 (the default): a
  // producer running as this process's user or as root only (frames from another user's
  // process are refused unless named here).
  int64_t producer_uid;
  // Non-zero: when the producer goes away, `gpushm_subscriber_next_frame` connects again
  // (waiting up to connect_timeout_ns, within its own timeout) instead of returning
  // GPUSHM_ERROR_DISCONNECTED; it returns that when no producer came back in
  // connect_timeout_ns. While none is there, the subscriber's fd wakes every 100 ms.
  int reconnect;
  // Non-zero: accept a producer's device ring (frames in GPU memory: read them through
  // `gpushm_frame_cuda_ptr`, their `data` pointers are NULL).
  int device_memory;
  // A name for the producer's logs and statistics (NULL: "pid N").
  const char *name;
  // Low-latency mode (0, the default: off): CPU time in microseconds a waiting
  // `gpushm_subscriber_next_frame` may spend per frame polling the ring around the time the
  // next frame is due (learnt from the producer's cadence) instead of sleeping until the
  // frame wakes it. Saves the wake-up of a sleeping core (tens of µs) for a bounded spin; a
  // frame earlier or later than expected still wakes it, a paused producer costs one
  // budget, then nothing. 100 to 500 suits most machines; at most 100000.
  uint32_t spin_us;
} gpushm_subscriber_options;

// One plane of a frame or slot.
typedef struct {
  // The plane's first byte (NULL for a frame in GPU memory). A received frame is mapped
  // read-only: only a publisher's slot may be written.
  uint8_t *data;
  // Bytes from one row to the next.
  uint32_t stride;
  // Rows.
  uint32_t rows;
  // Visible bytes of each row.
  uint32_t row_bytes;
  // Bytes from the frame's first byte to the plane's.
  uint64_t offset;
} gpushm_plane;

// What a frame (or a slot to fill) is. Pointers stay valid until the frame is released (the
// slot published or discarded).
typedef struct {
  // GStreamer's name of the raw video format ("NV12", "RGBA", ...), empty when the stream
  // is not raw video (its bytes are then in `data`/`size` only).
  char format[16];
  uint32_t width;
  uint32_t height;
  uint32_t n_planes;
  gpushm_plane planes[GPUSHM_MAX_PLANES];
  // The whole frame (NULL for a frame in GPU memory) and its size in bytes.
  uint8_t *data;
  uint64_t size;
  // Presentation and decoding time stamps and duration in ns, as the producer set them
  // (GPUSHM_TIME_NONE: not set).
  uint64_t pts;
  uint64_t dts;
  uint64_t duration;
  // The producer's frame counter (GstBuffer offset).
  uint64_t offset;
  // GstBufferFlags of the frame (keyframe: not GST_BUFFER_FLAG_DELTA_UNIT = 1 << 13).
  uint32_t flags;
  // When the producer published it (CLOCK_MONOTONIC ns).
  uint64_t publish_ns;
  // Non-zero: the frame is in GPU memory (a device ring): use `gpushm_frame_cuda_ptr`.
  int on_device;
} gpushm_frame_info;

// How a publisher serves frames. Fill it with `gpushm_publisher_options_init` first (see
// gpushm_subscriber_options on how the option structs may change before 1.0).
typedef struct {
  // Raw video format, GStreamer's name ("NV12", "I420", "RGBA", "BGRx", "GRAY8", ...).
  const char *format;
  uint32_t width;
  uint32_t height;
  // Frame rate, fps_n / fps_d.
  uint32_t fps_n;
  uint32_t fps_d;
  // Frames in the ring (2..64).
  uint32_t slots;
  // Permissions of the socket file (0600 by default: this user only).
  uint32_t perms;
  // -1 (the default): the ring in host memory; a CUDA device ordinal: a device ring in
  // that GPU's memory (consumers must accept device memory).
  int cuda_device;
  // Low-latency mode of `gpushm_publisher_publish`'s wait for a lossless consumer that
  // holds its whole budget (0, the default: off): poll its releases for up to this many µs
  // before sleeping, at most once a frame. Pays off for small frames sent flat out. At
  // most 100000 (GPUSHM_ERROR_INVALID_ARGUMENT above).
  uint32_t spin_us;
} gpushm_publisher_options;

// Success.
#define GPUSHM_OK 0

// Nothing came within the timeout (a frame, a free slot, a producer).
#define GPUSHM_TIMEOUT 1

// The producer ended the stream: no frame follows.
#define GPUSHM_EOS 2

// The wait was interrupted by `gpushm_subscriber_interrupt` (or the subscriber's destroy).
#define GPUSHM_INTERRUPTED 3

// A NULL pointer, an out-of-range value or a malformed string among the arguments.
#define GPUSHM_ERROR_INVALID_ARGUMENT -1

// A handle that is NULL, destroyed already, or of another kind.
#define GPUSHM_ERROR_BAD_HANDLE -2

// A frame used after `gpushm_frame_release`, or a slot after it was published or discarded.
#define GPUSHM_ERROR_RELEASED -3

// The producer went away (and `reconnect` is off, or no producer came back in time).
#define GPUSHM_ERROR_DISCONNECTED -4

// The producer refused this consumer, saying why (see `gpushm_last_error`).
#define GPUSHM_ERROR_REFUSED -5

// The peer broke the protocol or wrote invalid shared memory.
#define GPUSHM_ERROR_PROTOCOL -6

// A system call failed (see `gpushm_last_error`).
#define GPUSHM_ERROR_SYSTEM -7

// The request needs a CUDA GPU this process cannot use.
#define GPUSHM_ERROR_NO_GPU -8

// A bug in gpushm, caught at the boundary (please report `gpushm_last_error`).
#define GPUSHM_ERROR_INTERNAL -9

// The producer took the frame back: it cut this consumer for holding every slot of its ring
// for too long (see `gpushm_frame_is_valid`). Pointers into the frame may show newer frames.
#define GPUSHM_ERROR_REVOKED -10

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Fills `opts` with the defaults: auto delivery, 5 s to connect, producers of this user (or
// root) only, no reconnect, host memory only, no name.
gpushm_status gpushm_subscriber_options_init(gpushm_subscriber_options *opts);

// Connects to the producer serving `path` (waiting up to `opts->connect_timeout_ns` for one to
// appear; NULL `opts`: the defaults). On success `*out` is a subscriber to destroy with
// `gpushm_subscriber_destroy`. GPUSHM_TIMEOUT when no producer came.
gpushm_status gpushm_subscriber_open(const char *path,
                                     const gpushm_subscriber_options *opts,
                                     gpushm_subscriber **out);

// Connects like `gpushm_subscriber_open` to the producer of stream `name` (gpushmsink
// stream=NAME, `gpushm_publisher_open_stream`): found in $GPUSHM_RUNTIME_DIR if set, else in
// this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID) and then /run/gpushm,
// looked up again at each attempt while waiting. GPUSHM_ERROR_INVALID for a name that is not
// 1 to 64 letters, digits and . _ - @ + : (not starting with . or -).
gpushm_status gpushm_subscriber_open_stream(const char *name,
                                            const gpushm_subscriber_options *opts,
                                            gpushm_subscriber **out);

// Waits up to `timeout_ns` (negative: as long as it takes; 0: only looks) for the next
// frame. GPUSHM_OK: `*frame` is a frame to release and destroy. GPUSHM_TIMEOUT: none came
// (with 0, also when another thread is waiting on this subscriber). GPUSHM_EOS: the stream
// ended. GPUSHM_INTERRUPTED: `gpushm_subscriber_interrupt` was called, or the subscriber
// destroyed. Calls on one subscriber from several threads take turns.
gpushm_status gpushm_subscriber_next_frame(gpushm_subscriber *sub,
                                           int64_t timeout_ns,
                                           gpushm_frame **frame);

// `gpushm_subscriber_next_frame` and `gpushm_frame_get_info` in one call: on GPUSHM_OK,
// `*frame` is the frame (to release and destroy) and `*info` describes it. One handle
// lookup less per frame: the way to take frames where every microsecond counts.
gpushm_status gpushm_subscriber_next_frame_info(gpushm_subscriber *sub,
                                                int64_t timeout_ns,
                                                gpushm_frame **frame,
                                                gpushm_frame_info *info);

// A descriptor to wait on with poll/epoll/select (or an event loop such as a ROS executor)
// instead of blocking in `gpushm_subscriber_next_frame`: it is readable when a frame (or
// EOS, or news from the producer) may be there; then call `gpushm_subscriber_next_frame` with
// a timeout of 0. It belongs to the subscriber: do not close it. (From the first call on, the
// producer rings a doorbell for each frame, which a blocking user does not need.) Ask for it
// before another thread waits on the subscriber: this call waits while one does.
gpushm_status gpushm_subscriber_fd(gpushm_subscriber *sub, int *fd);

// How the low-latency mode (`spin_us`) fares on the current connection: frames that came
// while the ring was polled (`caught`, each saved a wake-up) and polls that ended without one
// (`missed`, each cost its budget). Both 0 without the mode, before the first frame and after
// a reconnect. Misses that grow with every frame mean the producer jitters more than the
// budget covers. Like `gpushm_subscriber_fd`, it waits while another thread waits on the
// subscriber.
gpushm_status gpushm_subscriber_spin_stats(gpushm_subscriber *sub,
                                           uint64_t *caught,
                                           uint64_t *missed);

// Makes a `gpushm_subscriber_next_frame` waiting on this subscriber (in another thread)
// return GPUSHM_INTERRUPTED now (or the next one, if none waits).
gpushm_status gpushm_subscriber_interrupt(gpushm_subscriber *sub);

// The producer's caps (a GStreamer caps string), copied into `buf` (`len` bytes, with the
// terminating NUL; truncated if longer). `*needed` (if not NULL) gets the length with NUL.
// Waits while another thread waits for a frame on this subscriber.
gpushm_status gpushm_subscriber_caps(gpushm_subscriber *sub, char *buf, size_t len, size_t *needed);

// Closes the connection and frees the subscriber. Frames it gave stay valid until released.
// Every `gpushm_subscriber_next_frame` waiting on it in other threads returns
// GPUSHM_INTERRUPTED.
gpushm_status gpushm_subscriber_destroy(gpushm_subscriber *sub);

// `*valid` is 1 while the frame is still this consumer's, 0 once the producer took it back
// (see gpushm_frame): check it after reading a frame you kept for long, and drop what you
// read if it is 0. GPUSHM_ERROR_RELEASED after release.
gpushm_status gpushm_frame_is_valid(const gpushm_frame *frame, int *valid);

// Describes the frame: format, size, planes (pointers into the ring, valid until the frame
// is released), time stamps, flags.
gpushm_status gpushm_frame_get_info(const gpushm_frame *frame, gpushm_frame_info *info);

// The frame's caps (a GStreamer caps string); the pointer stays valid until the frame is
// destroyed.
gpushm_status gpushm_frame_get_caps(const gpushm_frame *frame, const char **caps);

// The frame's address for CUDA kernels on `cuda_device` (an ordinal; -1: the first GPU), in
// `*device_ptr` (a CUdeviceptr). A frame of a device ring is read there in place; a frame of a
// host ring is read in place over the bus (or at memory speed on Jetson) once its ring is
// registered with CUDA, which the first call for a ring does (once per ring, never per frame;
// it creates this process's CUDA context). GPUSHM_ERROR_NO_GPU without a usable GPU.
gpushm_status gpushm_frame_cuda_ptr(const gpushm_frame *frame,
                                    int cuda_device,
                                    uint64_t *device_ptr);

// Gives the frame back to the producer: its pointers are invalid from now on, and further
// calls on it (but `gpushm_frame_destroy`) return GPUSHM_ERROR_RELEASED.
gpushm_status gpushm_frame_release(gpushm_frame *frame);

// Frees the frame handle, releasing the frame first if it was not.
gpushm_status gpushm_frame_destroy(gpushm_frame *frame);

// Fills `opts` with the defaults: GRAY8 (set format, width and height), 30/1 fps, 8 slots,
// socket permissions 0600, host memory.
gpushm_status gpushm_publisher_options_init(gpushm_publisher_options *opts);

// Serves raw video at `path` (a unix socket it creates, removed on destroy; gpushmsrc and
// subscribers connect there). `*out` is a publisher to destroy with
// `gpushm_publisher_destroy`.
gpushm_status gpushm_publisher_open(const char *path,
                                    const gpushm_publisher_options *opts,
                                    gpushm_publisher **out);

// Serves raw video like `gpushm_publisher_open`, as stream `name`: the socket is made in
// $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or
// /tmp/gpushm-UID, created mode 0700). Consumers give the same name (gpushmsrc stream=NAME,
// `gpushm_subscriber_open_stream`). GPUSHM_ERROR_INVALID for a bad name or a directory that
// cannot be trusted (another user's), saying why.
gpushm_status gpushm_publisher_open_stream(const char *name,
                                           const gpushm_publisher_options *opts,
                                           gpushm_publisher **out);

// Lends a free slot to fill, waiting up to `timeout_ns` (negative: as long as it takes) while
// consumers hold them all (GPUSHM_TIMEOUT). Fill it through `gpushm_slot_get_info`, then
// `gpushm_publisher_publish` it (or `gpushm_slot_discard` it).
gpushm_status gpushm_publisher_acquire(gpushm_publisher *publisher,
                                       int64_t timeout_ns,
                                       gpushm_slot **slot);

// Where to write the frame: the slot's planes (`data` NULL for a device ring's slot: write it
// with `gpushm_slot_cuda_ptr`).
gpushm_status gpushm_slot_get_info(const gpushm_slot *slot, gpushm_frame_info *info);

// The device address of a device ring's slot (write the frame there with CUDA, and finish
// before publishing); GPUSHM_ERROR_NO_GPU for a slot in host memory.
gpushm_status gpushm_slot_cuda_ptr(const gpushm_slot *slot, uint64_t *device_ptr);

// Publishes a filled slot to every consumer; `capture_ns` is when it was captured
// (CLOCK_MONOTONIC ns; 0: now). The slot handle is gone after this call, whatever it returns.
gpushm_status gpushm_publisher_publish(gpushm_publisher *publisher,
                                       gpushm_slot *slot,
                                       uint64_t capture_ns);

// Gives a slot back unpublished; the handle is gone after this call.
gpushm_status gpushm_slot_discard(gpushm_slot *slot);

// Tells every consumer the stream ended (they get GPUSHM_EOS after the frames before).
gpushm_status gpushm_publisher_send_eos(gpushm_publisher *publisher);

// Wakes the consumers that sleep waiting for a frame, ahead of the next one: call it a few
// µs before `gpushm_publisher_publish` (as the frame's last step starts), so that their
// wake-up (tens of µs on a core that idled) runs meanwhile. Once per frame; it wakes nobody
// less than 0.5 ms after the last frame, nor a consumer that went to sleep on this thread's
// CPU, nor one whose event loop polls `gpushm_subscriber_fd`. Never blocks.
gpushm_status gpushm_publisher_wake_early(gpushm_publisher *publisher);

// Consumers woken ahead of a frame by `gpushm_publisher_wake_early` so far, one per consumer
// and frame.
gpushm_status gpushm_publisher_woken_early(gpushm_publisher *publisher, uint64_t *count);

// Wakes the consumers that sleep waiting for a frame `us` microseconds before each frame is
// due, as learnt from the intervals between the last frames published, from a thread of the
// publisher (0, the default: never; at most 1000). A consumer woken from a sleep of a few ms
// takes tens of µs to run (60-80 on the H100 machine): woken ahead, it is up and polling
// (at most 100 µs, once per frame) when the frame lands. For streams of at most 500 frames
// a second, never for a frame already half an interval late (a stream that stops costs
// one wake-up), once per frame (`gpushm_publisher_wake_early` rings again only for a frame
// that came more than 200 µs after it), by the same rules as `gpushm_publisher_wake_early`
// (its CPU is the one the last frame was published from).
gpushm_status gpushm_publisher_set_wake_ahead(gpushm_publisher *publisher, uint32_t us);

// Consumers woken before a frame was due (`gpushm_publisher_set_wake_ahead`) so far, one per
// consumer and frame (counted in `gpushm_publisher_woken_early` too).
gpushm_status gpushm_publisher_woken_ahead(gpushm_publisher *publisher, uint64_t *count);

// Consumers connected now.
gpushm_status gpushm_publisher_num_clients(gpushm_publisher *publisher, uint32_t *count);

// Stops serving (the socket file goes) and frees the publisher. Frames consumers hold stay
// valid for them; slots it lent and not published are given back.
gpushm_status gpushm_publisher_destroy(gpushm_publisher *publisher);

// Keeps this machine's CPUs in idle states that wake within `us` microseconds (0: the
// shallowest) until `gpushm_cpu_latency_release`: the kernel's CPU latency QoS
// (/dev/cpu_dma_latency), the companion of `spin_us` for the lowest latency. A core that
// slept in a deep idle state wakes with cold caches, and a frame's way after it costs
// several µs more on each side (about 10 on the dev VM). Costs power and no CPU time of this
// process, but with 0 idle cores poll instead of sleeping (in a VM each vCPU keeps a host
// core busy); a few µs still allows the lightest sleep states on most CPUs. The kernel drops
// the request when the process ends, however it ends. Needs write access to
// /dev/cpu_dma_latency (root, or a udev rule): GPUSHM_ERROR_SYSTEM otherwise, with
// `gpushm_last_error` saying so. Changes nothing where the kernel has no cpuidle driver
// (some VMs). `us` at most 1000000.
gpushm_status gpushm_cpu_latency_request(uint32_t us, gpushm_cpu_latency **out);

// The latency the kernel keeps the CPUs to now (the smallest of all requests), µs. Reading
// needs access too (read access: root, or the same udev rule).
gpushm_status gpushm_cpu_latency_current(uint32_t *us);

// Withdraws the request and frees it.
gpushm_status gpushm_cpu_latency_release(gpushm_cpu_latency *request);

// The calling thread's message for the last call that did not return GPUSHM_OK (empty after
// one that did). Valid until this thread's next gpushm call.
const char *gpushm_last_error(void);

// The library's version, "MAJOR.MINOR.PATCH".
const char *gpushm_version(void);

#ifdef __cplusplus
} // extern "C"
#endif // __cplusplus

#endif /* GPUSHM_H */
