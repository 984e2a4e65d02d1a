package io.txnlake.kafka;

import java.io.IOException;
import java.io.Serializable;
import java.nio.ByteBuffer;
import java.sql.Timestamp;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.NoSuchElementException;
import java.util.Set;
import java.util.zip.CRC32C;

import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.record.ControlRecordType;
import org.apache.kafka.common.record.DefaultRecordBatch;
import org.apache.kafka.common.record.MemoryRecords;
import org.apache.kafka.common.record.MutableRecordBatch;
import org.apache.kafka.common.record.Record;
import org.apache.kafka.common.record.RecordBatch;
import org.apache.kafka.common.record.TimestampType;
import org.apache.kafka.common.utils.BufferSupplier;
import org.apache.kafka.common.utils.CloseableIterator;
import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.JavaSparkContext;
import org.apache.spark.broadcast.Broadcast;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.classic.SparkSession;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.util.CollectionAccumulator;
import org.apache.spark.util.SerializableConfiguration;

/**
 * Kafka segments (record batch format v2) read on Spark with Kafka's own record classes, a
 * segment per task, each opened through Hadoop's FileSystem (file:, s3a:, ...). Called from
 * txn_engine/log/kafka_import.py through py4j; the mapping is docs/kafka-import.md's.
 *
 * <p>A segment is named by a spec line: {@code path \t topic \t base offset \t pid:first,...},
 * the last field the transactions open before it (from {@link #scan} of the earlier segments).
 * A batch that cannot be read becomes one row with {@code error} set and its byte position; the
 * rest of the segment is read while its framing allows.
 */
public final class SegmentReader {
    private SegmentReader() {}

    static final int BATCH_OVERHEAD = 12; // baseOffset and batchLength precede what batchLength counts
    static final int HEADER_TO_MAGIC = 17;
    static final int ATTRIBUTES_OFFSET = 21; // the CRC covers attributes .. end of batch

    /** The rows {@link #parse} yields: the ledger_entries columns, the Kafka-only ones, and the import's own. */
    public static final StructType SCHEMA = new StructType()
            .add("topic", DataTypes.StringType)
            .add("ledger_id", DataTypes.LongType)
            .add("entry_id", DataTypes.LongType)
            .add("entry_type", DataTypes.StringType)
            .add("txn_most_bits", DataTypes.LongType)
            .add("txn_least_bits", DataTypes.LongType)
            .add("producer_id", DataTypes.LongType)
            .add("producer_epoch", DataTypes.IntegerType)
            .add("sequence_id", DataTypes.LongType)
            .add("publish_time", DataTypes.TimestampType)
            // The key's bytes, all of them: ingest's validation keeps UTF-8 as `key` and the rest as `key_bytes`.
            .add("key_bytes", DataTypes.BinaryType)
            .add("payload", DataTypes.BinaryType)
            .add("headers", DataTypes.createArrayType(new StructType()
                    .add("key", DataTypes.StringType).add("value", DataTypes.BinaryType)))
            .add("timestamp_type", DataTypes.StringType)
            // Byte offset of the record's batch in its segment: where a problem is reported.
            .add("batch_position", DataTypes.LongType)
            // A batch that cannot be read (CRC, codec, framing): one row, with the reason.
            .add("error", DataTypes.StringType)
            .add("source_file", DataTypes.StringType);

    /** Every record of the segments, a segment per task; each segment's "path \t rows" added to {@code done} when read. */
    public static Dataset<Row> parse(SparkSession spark, List<String> specs, CollectionAccumulator<String> done) {
        JavaSparkContext jsc = JavaSparkContext.fromSparkContext(spark.sparkContext());
        Broadcast<SerializableConfiguration> conf = jsc.broadcast(new SerializableConfiguration(jsc.hadoopConfiguration()));
        JavaRDD<Row> rows = jsc.parallelize(specs, Math.max(1, specs.size()))
                .flatMap(spec -> new SegmentRows(Spec.of(spec), conf.value().value(), done));
        return spark.createDataFrame(rows, SCHEMA);
    }

    /**
     * Per segment, a spec's path and what the transaction chain needs of it:
     * {@code path \t pid:first:carried,... \t pid,...}: the transactions open at its end (their
     * provisional first offset and whether they were open where it starts) and the producers
     * whose transaction was open where it starts. Reads batch headers and checksums only.
     */
    public static List<String> scan(SparkSession spark, List<String> specs) {
        JavaSparkContext jsc = JavaSparkContext.fromSparkContext(spark.sparkContext());
        Broadcast<SerializableConfiguration> conf = jsc.broadcast(new SerializableConfiguration(jsc.hadoopConfiguration()));
        return jsc.parallelize(specs, Math.max(1, specs.size()))
                .map(spec -> scanOne(Spec.of(spec), conf.value().value()))
                .collect();
    }

    static String scanOne(Spec spec, org.apache.hadoop.conf.Configuration conf) throws IOException {
        TxnChain chain = new TxnChain(Map.of());
        try (Frames frames = new Frames(spec.path, conf)) {
            while (frames.next()) {
                if (frames.error != null) {
                    break;
                }
                MutableRecordBatch batch = frames.batch();
                if (batch == null) {
                    continue; // a framing the record classes refuse: parse reports it
                }
                if ((batch.isTransactional() || batch.isControlBatch()) && batch.isValid()) {
                    chain.onBatch(batch);
                }
            }
        }
        StringBuilder out = new StringBuilder(spec.path).append('\t');
        chain.open.forEach((pid, txn) -> out.append(pid).append(':').append(txn[0]).append(':').append(txn[1]).append(','));
        out.append('\t');
        chain.carried.forEach(pid -> out.append(pid).append(','));
        return out.toString();
    }

    /** A segment spec line, parsed. */
    static final class Spec implements Serializable {
        final String path;
        final String topic;
        final long base;
        final Map<Long, Long> openBefore = new HashMap<>();

        private Spec(String path, String topic, long base) {
            this.path = path;
            this.topic = topic;
            this.base = base;
        }

        static Spec of(String line) {
            String[] f = line.split("\t", -1);
            Spec spec = new Spec(f[0], f[1], Long.parseLong(f[2]));
            if (f.length > 3) {
                for (String pair : f[3].split(",")) {
                    if (!pair.isEmpty()) {
                        int colon = pair.indexOf(':');
                        spec.openBefore.put(Long.parseLong(pair.substring(0, colon)), Long.parseLong(pair.substring(colon + 1)));
                    }
                }
            }
            return spec;
        }
    }

    /**
     * The broker's rule for a transaction in a partition's log: a producer's transactional batches
     * up to its next control batch. Its id is (producer id, offset of its first record); one open
     * where the segment starts takes its first offset from {@code openBefore}, or, when that does
     * not know it, the offset of its first record in this segment.
     */
    static final class TxnChain {
        final Map<Long, Long> openBefore;
        // Per producer, its transaction open at this point: {provisional first offset, 1 if open where the segment starts}.
        final Map<Long, long[]> open = new HashMap<>();
        final Set<Long> closedHere = new HashSet<>();
        final Set<Long> carried = new HashSet<>();

        TxnChain(Map<Long, Long> openBefore) {
            this.openBefore = openBefore;
        }

        /** The transaction's first offset, for a transactional or control batch whose checksum holds. */
        long onBatch(RecordBatch batch) {
            long pid = batch.producerId();
            long[] txn;
            if (batch.isControlBatch()) {
                txn = open.remove(pid);
                boolean closedBefore = !closedHere.add(pid);
                if (txn == null) { // no data of it before the marker in this segment
                    txn = new long[] {batch.baseOffset(), closedBefore ? 0 : 1};
                }
            } else {
                txn = open.get(pid);
                if (txn == null) {
                    txn = new long[] {batch.baseOffset(), closedHere.contains(pid) ? 0 : 1};
                    open.put(pid, txn);
                }
            }
            if (txn[1] == 1) {
                carried.add(pid);
                Long first = openBefore.get(pid);
                if (first != null) {
                    return first;
                }
            }
            return txn[0];
        }
    }

    /** A segment's batches in order, each read whole; a framing that cannot go on sets {@code error} and ends it. */
    static final class Frames implements AutoCloseable {
        final String path;
        final long size;
        final FSDataInputStream in;
        byte[] buf = new byte[64 * 1024];
        long position = 0; // of the current batch
        long nextPosition = 0;
        int length; // of the current batch, all of it
        String error;

        Frames(String path, org.apache.hadoop.conf.Configuration conf) throws IOException {
            this.path = path;
            Path p = new Path(path);
            FileSystem fs = p.getFileSystem(conf);
            this.size = fs.getFileStatus(p).getLen();
            this.in = fs.open(p);
        }

        boolean next() throws IOException {
            if (error != null || nextPosition >= size) {
                return false;
            }
            position = nextPosition;
            long left = size - position;
            if (left < HEADER_TO_MAGIC) {
                error = left + " trailing bytes at byte " + position + ", too few for a batch header";
                return true;
            }
            in.readFully(buf, 0, HEADER_TO_MAGIC);
            ByteBuffer head = ByteBuffer.wrap(buf, 0, HEADER_TO_MAGIC);
            int batchLength = head.getInt(8);
            byte magic = head.get(16);
            if (magic != RecordBatch.MAGIC_VALUE_V2) {
                error = "batch at byte " + position + " has magic byte " + magic + ", not format v2";
                return true;
            }
            long end = position + BATCH_OVERHEAD + (long) batchLength;
            if (batchLength < DefaultRecordBatch.RECORD_BATCH_OVERHEAD - BATCH_OVERHEAD || end > size) {
                error = "batch at byte " + position + " claims " + batchLength + " bytes, the segment has "
                        + (left - BATCH_OVERHEAD);
                return true;
            }
            length = BATCH_OVERHEAD + batchLength;
            if (buf.length < length) {
                byte[] bigger = new byte[Math.max(length, buf.length * 2)];
                System.arraycopy(buf, 0, bigger, 0, HEADER_TO_MAGIC);
                buf = bigger;
            }
            in.readFully(buf, HEADER_TO_MAGIC, length - HEADER_TO_MAGIC);
            nextPosition = end;
            return true;
        }

        /** The current batch through Kafka's classes (the buffer is reused: read it before the next). */
        MutableRecordBatch batch() {
            Iterator<MutableRecordBatch> it = MemoryRecords.readableRecords(ByteBuffer.wrap(buf, 0, length)).batches().iterator();
            return it.hasNext() ? it.next() : null;
        }

        String crcError(MutableRecordBatch batch) {
            CRC32C crc = new CRC32C();
            crc.update(buf, ATTRIBUTES_OFFSET, length - ATTRIBUTES_OFFSET);
            return String.format("batch at byte %d fails its CRC-32C check (stored 0x%08x, computed 0x%08x)",
                    position, batch.checksum(), crc.getValue());
        }

        @Override
        public void close() throws IOException {
            in.close();
        }
    }

    /** One segment's rows, a batch at a time. */
    static final class SegmentRows implements Iterator<Row> {
        final Spec spec;
        final CollectionAccumulator<String> done;
        final Frames frames;
        final TxnChain chain;
        final BufferSupplier buffers = BufferSupplier.create();
        final ArrayDeque<Row> pending = new ArrayDeque<>();
        long lastOffset = Long.MIN_VALUE;
        long rows = 0;
        boolean finished = false;

        SegmentRows(Spec spec, org.apache.hadoop.conf.Configuration conf, CollectionAccumulator<String> done) throws IOException {
            this.spec = spec;
            this.done = done;
            this.frames = new Frames(spec.path, conf);
            this.chain = new TxnChain(spec.openBefore);
        }

        @Override
        public boolean hasNext() {
            while (pending.isEmpty() && !finished) {
                try {
                    if (!frames.next()) {
                        finish();
                    } else if (frames.error != null) {
                        pending.add(errorRow(frames.position, frames.error));
                    } else {
                        readBatch();
                    }
                } catch (IOException e) {
                    throw new java.io.UncheckedIOException(spec.path + ": " + e.getMessage(), e);
                }
            }
            return !pending.isEmpty();
        }

        @Override
        public Row next() {
            if (!hasNext()) {
                throw new NoSuchElementException();
            }
            rows++;
            return pending.poll();
        }

        private void finish() throws IOException {
            finished = true;
            frames.close();
            buffers.close();
            if (done != null) {
                done.add(spec.path + "\t" + rows);
            }
        }

        private Row errorRow(long position, String reason) {
            return RowFactory.create(spec.topic, spec.base, null, null, null, null, null, null, null, null, null, null,
                    null, null, position, reason, spec.path);
        }

        private void readBatch() {
            long position = frames.position;
            List<Row> out = new ArrayList<>();
            long last = lastOffset;
            try {
                MutableRecordBatch batch = frames.batch();
                if (batch == null) {
                    throw new IllegalStateException("batch at byte " + position + " cannot be framed");
                }
                if (!batch.isValid()) {
                    pending.add(errorRow(position, frames.crcError(batch)));
                    return;
                }
                boolean control = batch.isControlBatch();
                Long txnMost = null;
                Long txnLeast = null;
                if (batch.isTransactional() || control) {
                    txnMost = batch.producerId();
                    txnLeast = chain.onBatch(batch);
                }
                boolean hasProducer = batch.producerId() != RecordBatch.NO_PRODUCER_ID;
                Long producerId = hasProducer ? batch.producerId() : null;
                Integer epoch = hasProducer && batch.producerEpoch() >= 0 ? (int) batch.producerEpoch() : null;
                int baseSequence = batch.baseSequence();
                String timestampType = batch.timestampType() == TimestampType.LOG_APPEND_TIME ? "LOG_APPEND_TIME" : "CREATE_TIME";
                try (CloseableIterator<Record> records = batch.streamingIterator(buffers)) {
                    while (records.hasNext()) {
                        Record r = records.next();
                        long offset = r.offset();
                        if (offset <= last) {
                            throw new IllegalStateException("record at offset " + offset + " does not follow offset " + last);
                        }
                        last = offset;
                        String type = "DATA";
                        if (control) {
                            ControlRecordType kind = r.hasKey() && r.keySize() >= 4 ? ControlRecordType.parse(r.key()) : null;
                            if (kind == null) {
                                throw new IllegalStateException("control record at offset " + offset + " has no type");
                            }
                            if (kind != ControlRecordType.COMMIT && kind != ControlRecordType.ABORT) {
                                throw new IllegalStateException("control record type " + kind + " at offset " + offset
                                        + " is neither ABORT (0) nor COMMIT (1)");
                            }
                            type = kind == ControlRecordType.COMMIT ? "COMMIT" : "ABORT";
                        }
                        Long sequence = baseSequence >= 0 && !control ? (long) baseSequence + (offset - batch.baseOffset()) : null;
                        long ts = r.timestamp();
                        Header[] headers = r.headers();
                        Row[] headerRows = null; // Kafka cannot tell no headers from an empty list: null
                        if (headers.length > 0) {
                            headerRows = new Row[headers.length];
                            for (int i = 0; i < headers.length; i++) {
                                headerRows[i] = RowFactory.create(headers[i].key(), headers[i].value());
                            }
                        }
                        out.add(RowFactory.create(spec.topic, spec.base, offset - spec.base, type, txnMost, txnLeast, producerId,
                                epoch, sequence, ts >= 0 ? new Timestamp(ts) : null, bytes(r.key()), bytes(r.value()),
                                headerRows == null ? null : scala.jdk.javaapi.CollectionConverters.asScala(java.util.Arrays.asList(headerRows)).toSeq(), timestampType, position, null,
                                spec.path));
                    }
                }
            } catch (RuntimeException e) {
                String reason = e.getMessage() == null ? e.getClass().getSimpleName() : e.getMessage();
                pending.add(errorRow(position, reason.startsWith("batch at byte") ? reason
                        : "batch at byte " + position + ": " + e.getClass().getSimpleName() + ": " + reason));
                return;
            }
            lastOffset = last;
            pending.addAll(out);
        }

        private static byte[] bytes(ByteBuffer b) {
            if (b == null) {
                return null;
            }
            byte[] out = new byte[b.remaining()];
            b.duplicate().get(out);
            return out;
        }
    }
}
