//! Tests only: write tensors as a PyTorch `pytorch_model.bin` (the zip layout `torch.save`
//! writes: `archive/data.pkl`, a protocol-2 pickle of an OrderedDict of
//! `torch._utils._rebuild_tensor_v2` calls, and one raw storage file per tensor), so the
//! loaders' second file format is tested without Python.

use std::{io::Write, path::Path};

use candle_core::{DType, Tensor};

/// Pickle opcodes used here.
const PROTO: u8 = 0x80;
const GLOBAL: u8 = b'c';
const EMPTY_TUPLE: u8 = b')';
const REDUCE: u8 = b'R';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const BINUNICODE: u8 = b'X';
const BININT: u8 = b'J';
const BINPERSID: u8 = b'Q';
const NEWFALSE: u8 = 0x89;
const SETITEM: u8 = b's';
const STOP: u8 = b'.';

struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, op: u8) -> &mut Self {
        self.0.push(op);
        self
    }
    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.0.push(GLOBAL);
        self.0.extend(format!("{module}\n{name}\n").bytes());
        self
    }
    fn text(&mut self, s: &str) -> &mut Self {
        self.0.push(BINUNICODE);
        self.0.extend((s.len() as u32).to_le_bytes());
        self.0.extend(s.bytes());
        self
    }
    fn int(&mut self, i: usize) -> &mut Self {
        self.0.push(BININT);
        self.0.extend((i as i32).to_le_bytes());
        self
    }
    fn ints(&mut self, values: &[usize]) -> &mut Self {
        self.op(MARK);
        for &v in values {
            self.int(v);
        }
        self.op(TUPLE)
    }
    fn ordered_dict(&mut self) -> &mut Self {
        self.global("collections", "OrderedDict").op(EMPTY_TUPLE).op(REDUCE)
    }
}

/// Write `tensors` (f32, f16 or i64, contiguous) to `path` as `torch.save(state_dict)` would.
pub fn save_pth(tensors: &[(String, Tensor)], path: &Path) {
    let mut p = Pickle(vec![PROTO, 2]);
    p.ordered_dict();
    let mut storages = Vec::new();
    for (index, (name, tensor)) in tensors.iter().enumerate() {
        let storage = match tensor.dtype() {
            DType::F32 => "FloatStorage",
            DType::F16 => "HalfStorage",
            DType::I64 => "LongStorage",
            other => panic!("no PyTorch storage written for {other:?}"),
        };
        let dims = tensor.dims().to_vec();
        let mut strides = vec![1usize; dims.len()];
        for d in (0..dims.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * dims[d + 1];
        }
        let key = index.to_string();
        p.text(name).global("torch._utils", "_rebuild_tensor_v2").op(MARK);
        p.op(MARK).text("storage").global("torch", storage).text(&key).text("cpu").int(tensor.elem_count()).op(TUPLE);
        p.op(BINPERSID).int(0).ints(&dims).ints(&strides).op(NEWFALSE).ordered_dict();
        p.op(TUPLE).op(REDUCE).op(SETITEM);
        let mut bytes = Vec::new();
        tensor.flatten_all().unwrap().write_bytes(&mut bytes).unwrap();
        storages.push((key, bytes));
    }
    p.op(STOP);

    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let stored = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("archive/data.pkl", stored).unwrap();
    zip.write_all(&p.0).unwrap();
    for (key, bytes) in storages {
        zip.start_file(format!("archive/data/{key}"), stored).unwrap();
        zip.write_all(&bytes).unwrap();
    }
    zip.finish().unwrap();
}
