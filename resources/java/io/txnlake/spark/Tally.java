package io.txnlake.spark;

import java.util.HashMap;
import java.util.Map;

import org.apache.spark.sql.Encoder;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.expressions.Aggregator;
import org.apache.spark.sql.functions;

/**
 * Rows counted by a string key, as one aggregate: "key \t count" lines. A grouped count that can
 * be observed (`Dataset.observe`) during a job that does something else, such as a write,
 * where a groupBy would need a job of its own.
 */
public final class Tally extends Aggregator<String, Tally.Counts, String> {
    /** The buffer: a bean, so that its encoder is plain expressions, which interpreted plans can ship too. */
    public static final class Counts implements java.io.Serializable {
        private HashMap<String, Long> counts = new HashMap<>();

        public Map<String, Long> getCounts() {
            return counts;
        }

        public void setCounts(Map<String, Long> counts) {
            this.counts = new HashMap<>(counts);
        }
    }

    public static final String NAME = "txnlake_tally";

    /** Registers the aggregate as {@code txnlake_tally(key)} in the session (idempotent). */
    public static void register(SparkSession spark) {
        spark.udf().register(NAME, functions.udaf(new Tally(), Encoders.STRING()));
    }

    @Override
    public Counts zero() {
        return new Counts();
    }

    @Override
    public Counts reduce(Counts buffer, String key) {
        buffer.counts.merge(key == null ? "" : key, 1L, Long::sum);
        return buffer;
    }

    @Override
    public Counts merge(Counts a, Counts b) {
        b.counts.forEach((key, n) -> a.counts.merge(key, n, Long::sum));
        return a;
    }

    @Override
    public String finish(Counts buffer) {
        StringBuilder out = new StringBuilder();
        for (Map.Entry<String, Long> e : buffer.counts.entrySet()) {
            out.append(e.getKey()).append('\t').append(e.getValue()).append('\n');
        }
        return out.toString();
    }

    @Override
    public Encoder<Counts> bufferEncoder() {
        return Encoders.bean(Counts.class);
    }

    @Override
    public Encoder<String> outputEncoder() {
        return Encoders.STRING();
    }
}
