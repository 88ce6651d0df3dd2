// SPDX-License-Identifier: MPL-2.0
//! GStreamer 1.24's meta serialization (`gst_meta_serialize_simple`, `gst_meta_deserialize`),
//! found at run time: the plugin is built against 1.20 (JetPack 6), so on an older runtime
//! these metas simply do not travel. It carries every meta whose implementation can
//! serialize itself and that gpushm does not carry another way (see [`travels_serialized`]).
//!
//! What a consumer deserializes comes from another process. `gst_meta_deserialize` trusts
//! the lengths in the header it reads (a name length near 4 GiB overflows its bounds check),
//! so the header is checked here first: the lengths, the name's NUL, and the meta's kind. A
//! meta that describes the buffer's memory (the `memory` tag: video and audio layouts) is
//! refused: the ring's own fields say where a frame's bytes are, checked against the slot.

use gst::glib;
use gst::glib::translate::from_glib;
use once_cell::sync::Lazy;

type SerializeFn = unsafe extern "C" fn(
    *const gst::ffi::GstMeta,
    *mut glib::ffi::GByteArray,
) -> glib::ffi::gboolean;
type DeserializeFn = unsafe extern "C" fn(
    *mut gst::ffi::GstBuffer,
    *const u8,
    usize,
    *mut u32,
) -> *mut gst::ffi::GstMeta;

struct Api {
    serialize: SerializeFn,
    deserialize: DeserializeFn,
}

/// The 1.24 functions in the libgstreamer this process runs with, if it has them.
static API: Lazy<Option<Api>> = Lazy::new(|| {
    use libloading::os::unix::{Library, RTLD_LAZY};
    // The libgstreamer loaded already (we are its plugin or app), by its name: loaded with
    // RTLD_LOCAL (PyGObject does) its symbols are not in the process's global scope.
    // SAFETY: NOLOAD opens nothing new; the signatures are those of gst/gstmeta.h (1.24).
    unsafe {
        let this = Library::open(
            Some("libgstreamer-1.0.so.0"),
            nix::libc::RTLD_NOLOAD | RTLD_LAZY,
        )
        .unwrap_or_else(|_| Library::this());
        let serialize = *this
            .get::<SerializeFn>(b"gst_meta_serialize_simple\0")
            .ok()?;
        let deserialize = *this.get::<DeserializeFn>(b"gst_meta_deserialize\0").ok()?;
        Some(Api {
            serialize,
            deserialize,
        })
    }
});

/// Whether this process's GStreamer can serialize metas (1.24 and newer).
pub fn available() -> bool {
    API.is_some()
}

/// A serialized meta is at most this long (a payload holds it in base64, under 64 KiB).
pub const MAX_SERIALIZED: usize = 40 * 1024;

/// Whether a meta of `api` travels serialized. Not custom metas and reference timestamps (a
/// line of their own, on every runtime), the time code (a field of the ring), gpushm's CUDA
/// meta (a pointer into one process), nor metas describing memory (the ring's plane fields).
fn travels_serialized(api: glib::Type, is_custom: bool) -> bool {
    !is_custom
        && api != <gst::ReferenceTimestampMeta as gst::meta::MetaAPI>::meta_api()
        && api != <gst_video::VideoTimeCodeMeta as gst::meta::MetaAPI>::meta_api()
        && api != <crate::cudameta::CudaMetaApi as gst::meta::MetaAPI>::meta_api()
        && !crate::frame_metas::api_describes_memory(api)
}

/// `meta` serialized by GStreamer, when this runtime can and the meta is one that travels
/// this way. `Err` names a meta too large to travel.
pub fn serialize(meta: &gst::MetaRef<'_, gst::Meta>) -> Result<Option<Vec<u8>>, String> {
    let Some(api) = API.as_ref() else {
        return Ok(None);
    };
    if !travels_serialized(meta.api(), meta.try_as_custom_meta().is_some()) {
        return Ok(None);
    }
    // SAFETY: a meta of a buffer we hold; the byte array is ours and freed below.
    let bytes = unsafe {
        let array = glib::ffi::g_byte_array_new();
        let ok = (api.serialize)(meta.as_ptr(), array);
        let bytes = (ok != 0 && !(*array).data.is_null())
            .then(|| std::slice::from_raw_parts((*array).data, (*array).len as usize).to_vec());
        glib::ffi::g_byte_array_unref(array);
        bytes
    };
    match bytes {
        Some(b) if b.len() > MAX_SERIALIZED => Err(meta.api().name().to_string()),
        b => Ok(b),
    }
}

/// Adds the meta serialized in `data` (by [`serialize`] in another process) to `buffer`.
pub fn deserialize(data: &[u8], buffer: &mut gst::BufferRef) -> Result<(), String> {
    let name = checked_name(data)?;
    let cname = std::ffi::CString::new(name.as_str()).map_err(|_| "a NUL in a name".to_string())?;
    // SAFETY: a NUL-terminated name; the info returned is static or NULL.
    let info = unsafe { gst::ffi::gst_meta_get_info(cname.as_ptr()) };
    if info.is_null() {
        // Registered where its library first uses it: a consumer pipeline that never did
        // cannot have downstream elements that read it either.
        return Err(format!("{name} is not a meta this process knows"));
    }
    // SAFETY: a registered meta's info, static.
    let (meta_api, is_custom) = unsafe {
        (
            from_glib::<_, glib::Type>((*info).api),
            gst::ffi::gst_meta_info_is_custom(info) != 0,
        )
    };
    // Refused before the runtime is asked about: the same on every GStreamer.
    if !travels_serialized(meta_api, is_custom) {
        return Err(format!("{name} does not travel serialized"));
    }
    let api = API
        .as_ref()
        .ok_or_else(|| format!("{name}: serialized metas need GStreamer 1.24 here"))?;
    let mut consumed = 0u32;
    // SAFETY: the header was checked against `data`'s length above (what
    // gst_meta_deserialize itself does not do whole); the buffer is writable.
    let meta = unsafe {
        (api.deserialize)(
            buffer.as_mut_ptr(),
            data.as_ptr(),
            data.len(),
            &mut consumed,
        )
    };
    if meta.is_null() {
        return Err(format!("{name}: GStreamer could not deserialize it"));
    }
    Ok(())
}

/// The meta name in the header of `data` (`[total u32 LE][name length u32 LE][name][NUL]
/// [version u8][payload]`, gst_meta_serialize's format), checked so that
/// gst_meta_deserialize reads within `data`: the total is `data`'s length, the name fits
/// with its NUL and version byte, and holds no other NUL.
fn checked_name(data: &[u8]) -> Result<String, String> {
    let word = |at: usize| {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as u64)
            .ok_or_else(|| format!("a serialized meta of {} bytes has no header", data.len()))
    };
    let total = word(0)?;
    let name_len = word(4)?;
    if total != data.len() as u64 {
        return Err(format!(
            "a serialized meta says {total} bytes and has {}",
            data.len()
        ));
    }
    if name_len == 0 || name_len > 256 || 8 + name_len + 2 > total {
        return Err(format!(
            "a serialized meta's name of {name_len} bytes does not fit"
        ));
    }
    let name = &data[8..8 + name_len as usize];
    if data[8 + name_len as usize] != 0 || name.contains(&0) {
        return Err("a serialized meta's name is not one string".into());
    }
    std::str::from_utf8(name)
        .map(str::to_string)
        .map_err(|_| "a serialized meta's name is not UTF-8".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::{c_char, c_void};

    /// GstMetaInfo as of 1.24 (the bindings are built for 1.20, which ends at transform_func).
    #[repr(C)]
    struct MetaInfo124 {
        api: glib::ffi::GType,
        type_: glib::ffi::GType,
        size: usize,
        init: Option<
            unsafe extern "C" fn(
                *mut gst::ffi::GstMeta,
                *mut c_void,
                *mut gst::ffi::GstBuffer,
            ) -> glib::ffi::gboolean,
        >,
        free: *const c_void,
        transform: *const c_void,
        serialize: Option<
            unsafe extern "C" fn(
                *const gst::ffi::GstMeta,
                *mut ByteArrayInterface,
                *mut u8,
            ) -> glib::ffi::gboolean,
        >,
        deserialize: Option<
            unsafe extern "C" fn(
                *const MetaInfo124,
                *mut gst::ffi::GstBuffer,
                *const u8,
                usize,
                u8,
            ) -> *mut gst::ffi::GstMeta,
        >,
        clear: *const c_void,
    }

    #[repr(C)]
    struct ByteArrayInterface {
        data: *mut u8,
        len: usize,
        resize: unsafe extern "C" fn(*mut ByteArrayInterface, usize) -> glib::ffi::gboolean,
    }

    /// A meta of a library of the user's: one number, serializable (as 1.24 lets a library
    /// make its metas).
    #[repr(C)]
    struct NumberMeta {
        meta: gst::ffi::GstMeta,
        n: u32,
    }

    unsafe extern "C" fn init(
        _: *mut gst::ffi::GstMeta,
        _: *mut c_void,
        _: *mut gst::ffi::GstBuffer,
    ) -> glib::ffi::gboolean {
        1
    }

    unsafe extern "C" fn serialize(
        meta: *const gst::ffi::GstMeta,
        out: *mut ByteArrayInterface,
        version: *mut u8,
    ) -> glib::ffi::gboolean {
        unsafe {
            let n = (*(meta as *const NumberMeta)).n.to_le_bytes();
            let at = (*out).len;
            if ((*out).resize)(out, at + 4) == 0 {
                return 0;
            }
            // resize() leaves the length to the caller (gst_byte_array_interface_append).
            (*out).len = at + 4;
            std::ptr::copy_nonoverlapping(n.as_ptr(), (*out).data.add(at), 4);
            *version = 1;
        }
        1
    }

    unsafe extern "C" fn deserialize(
        info: *const MetaInfo124,
        buffer: *mut gst::ffi::GstBuffer,
        data: *const u8,
        size: usize,
        _: u8,
    ) -> *mut gst::ffi::GstMeta {
        if size != 4 {
            return std::ptr::null_mut();
        }
        unsafe {
            let meta = gst::ffi::gst_buffer_add_meta(
                buffer,
                info as *const gst::ffi::GstMetaInfo,
                std::ptr::null_mut(),
            ) as *mut NumberMeta;
            (*meta).n = u32::from_le_bytes(std::slice::from_raw_parts(data, 4).try_into().unwrap());
            meta as *mut gst::ffi::GstMeta
        }
    }

    fn number_meta_info() -> *const gst::ffi::GstMetaInfo {
        static INFO: Lazy<usize> = Lazy::new(|| {
            let this = libloading::os::unix::Library::this();
            // SAFETY: gst/gstmeta.h (1.24) signatures; the info is filled before it is
            // registered, as gst_meta_info_new's documentation asks.
            unsafe {
                let new =
                    *this
                        .get::<unsafe extern "C" fn(
                            glib::ffi::GType,
                            *const c_char,
                            usize,
                        ) -> *mut MetaInfo124>(b"gst_meta_info_new\0")
                        .unwrap();
                let register = *this
                    .get::<unsafe extern "C" fn(*mut MetaInfo124) -> *const gst::ffi::GstMetaInfo>(
                        b"gst_meta_info_register\0",
                    )
                    .unwrap();
                let mut no_tags = [std::ptr::null::<c_char>()];
                let api = gst::ffi::gst_meta_api_type_register(
                    c"GpushmTestNumberMetaAPI".as_ptr(),
                    no_tags.as_mut_ptr() as _,
                );
                let info = new(
                    api,
                    c"GpushmTestNumberMeta".as_ptr(),
                    std::mem::size_of::<NumberMeta>(),
                );
                (*info).init = Some(init);
                (*info).serialize = Some(serialize);
                (*info).deserialize = Some(deserialize);
                register(info) as usize
            }
        });
        *INFO as *const gst::ffi::GstMetaInfo
    }

    /// A library's serializable meta travels: serialized here, checked, deserialized by
    /// GStreamer onto another buffer with its value.
    #[test]
    #[ignore = "needs GStreamer 1.24+ (Debian 12 has 1.22): .gst126/run the test binary"]
    fn a_serializable_meta_round_trips() {
        gst::init().unwrap();
        assert!(available());
        let info = number_meta_info();
        let mut b = gst::Buffer::with_size(16).unwrap();
        // SAFETY: our registered info; the meta's field is ours to set.
        unsafe {
            let m = gst::ffi::gst_buffer_add_meta(
                b.get_mut().unwrap().as_mut_ptr(),
                info,
                std::ptr::null_mut(),
            ) as *mut NumberMeta;
            (*m).n = 4242;
        }
        let (payload, left) = crate::frame_metas::encode(&b);
        assert!(left.is_empty());
        let payload = payload.expect("the meta travels");
        assert!(payload.starts_with("s "), "{payload}");
        let mut out = gst::Buffer::with_size(16).unwrap();
        let why = crate::frame_metas::apply(&payload, out.get_mut().unwrap());
        assert!(why.is_empty(), "{why:?}");
        // SAFETY: the api of our info; a meta of that api is a NumberMeta.
        let n = unsafe {
            let m =
                gst::ffi::gst_buffer_get_meta(out.as_mut_ptr(), (*info).api) as *const NumberMeta;
            assert!(!m.is_null());
            (*m).n
        };
        assert_eq!(n, 4242);
        // A payload cut short is refused by the header check, not read past.
        let bytes = gst::glib::base64_decode(payload[2..].trim_end());
        let short = format!("s {}", gst::glib::base64_encode(&bytes[..bytes.len() - 1]));
        let why = crate::frame_metas::apply(&short, out.get_mut().unwrap());
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].contains("says"), "{why:?}");
    }
}
